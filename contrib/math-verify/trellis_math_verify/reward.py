"""``math_verify``: a response's final answer checked symbolically against the ground truth.

``math_verify`` (the package) is imported on the first call, so listing plugins stays cheap.
"""

from __future__ import annotations

from typing import Any


def math_verify_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    float_rounding: int = 6,
    strict: bool = True,
    timeout_seconds: int | None = None,
) -> float:
    """1.0 when math-verify finds the response's answer equal to ``ground_truth``, else 0.0.

    The response is parsed as math-verify does (a ``\\boxed{}`` first, then other LaTeX, then plain
    expressions); a ground truth without ``$`` or ``\\boxed`` is parsed as if boxed. An answer that
    cannot be parsed scores 0.0. ``timeout_seconds`` bounds math-verify's own parsing and checking
    (signal-based: main thread only); None leaves the limit to the reward manager.

    Raises:
        ImportError: math-verify is not installed; the message says how to install it.
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "The 'math_verify' reward function needs the math-verify package: "
            "pip install 'math-verify>=0.7' (or pip install ./contrib/math-verify)."
        ) from exc
    truth = str(ground_truth)
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"\\boxed{{{truth}}}"
    gold = parse(truth, parsing_timeout=timeout_seconds)
    answer = parse(solution_str, parsing_timeout=timeout_seconds)
    if not gold or not answer:
        return 0.0
    same = verify(gold, answer, float_rounding=float_rounding, strict=strict, timeout_seconds=timeout_seconds)
    return 1.0 if same else 0.0

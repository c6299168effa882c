"""Built-in scoring functions, registered in ``trellis.reward_functions``.

Each follows the reward-function protocol
``score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
(called by keyword) and needs nothing beyond the standard library. A dict result carries its
reward under ``"score"``; its other fields are logged per sample.

The dispatcher :func:`default_compute_score` (``reward.function: null``) scores every data source
verl's ``default_compute_score`` scores and Trellis has a scorer for exactly as verl 0.9.1 does
(:mod:`trellis.reward.verl_rules`): ``gsm8k`` and ``math`` are those verl-identical scorers. The
lenient ones Trellis had before, which accept ``#### 1,000.0`` or ``\\boxed{0.75}`` for ``3/4``, are
:func:`gsm8k_lenient_score` and :func:`math_lenient_score` (``gsm8k_lenient``, ``math_lenient``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from trellis.errors import TrellisError
from trellis.reward.verl_rules import (
    geo3k_score,
    gsm8k_score,
    math_dapo_score,
    math_score,
    search_r1_score,
)

__all__ = [
    "DATA_SOURCES",
    "DATA_SOURCE_PREFIXES",
    "UnknownDataSourceError",
    "arithmetic_score",
    "default_compute_score",
    "exact_match_score",
    "extract_gsm8k_answer",
    "format_score",
    "geo3k_score",
    "gsm8k_lenient_score",
    "gsm8k_score",
    "is_math_equiv",
    "judge_score",
    "last_boxed",
    "math_dapo_score",
    "math_lenient_score",
    "math_score",
    "math_value",
    "normalize_math_answer",
    "normalize_number",
    "parse_final_integer",
    "parse_judge_score",
    "scorer_for",
    "search_r1_score",
]


class UnknownDataSourceError(TrellisError, LookupError):
    """``default_compute_score`` got a data_source it has no scoring function for."""


# ---------------------------------------------------------------- numbers

_NUMBER_RE = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_COMMA_INT_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize_number(text: Any) -> str | None:
    """The canonical spelling of a number: no ``$``, spaces, thousands commas, trailing ``.`` or ``.0``.

    ``"$1,234.50"`` -> ``"1234.5"``, ``"7.0"`` -> ``"7"``, ``"-0"`` -> ``"0"``. Returns None when
    ``text`` is not a number.
    """
    s = str(text).strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    negative = s.startswith("-")
    s = s.lstrip("+-")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    s = s.lstrip("0") or "0"
    if s.startswith("."):
        s = "0" + s
    return "-" + s if negative and s != "0" else s


_canon = normalize_number


def _last_number(text: str) -> str | None:
    matches = _NUMBER_RE.findall(text)
    for candidate in reversed(matches):
        value = _canon(candidate)
        if value is not None:
            return value
    return None


# ---------------------------------------------------------------- gsm8k, lenient

_GSM8K_STRICT_RE = re.compile(r"####\s*(-?[$\d.,\s]*\d[\d.,]*)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The normalised answer of a GSM8K-style response, or None (what :func:`gsm8k_lenient_score`
    reads; verl's reading is :func:`~trellis.reward.verl_rules.extract_gsm8k_answer_verl`).

    ``strict``: the number after the last ``####``. ``flexible``: the last number anywhere.

    Raises:
        ValueError: ``method`` is neither ``strict`` nor ``flexible``.
    """
    if method == "strict":
        matches = _GSM8K_STRICT_RE.findall(solution_str)
        return _canon(matches[-1]) if matches else None
    if method == "flexible":
        return _last_number(solution_str)
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}.")


def gsm8k_lenient_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K, leniently (registered as ``gsm8k_lenient``; verl's scoring is :func:`gsm8k_score`):
    ``score`` when the response's answer equals ``ground_truth`` as a number, else ``format_score``
    if an answer was found, else 0.

    Unlike verl it accepts ``#### $2652``, ``####2652`` and ``#### 2652.00`` for ``2652`` and reads the
    whole response, not its last 300 characters.

    ``method="strict"`` reads the number after the last ``#### ``; ``"flexible"`` the last number in
    the text. ``extra_info["method"]`` overrides the keyword per sample. Numbers are compared after
    normalisation (commas, ``$``, trailing ``.0``), so ``#### 1,000.0`` matches ``1000``.

    Raises:
        ValueError: unknown ``method``.
    """
    method = (extra_info or {}).get("method", method)
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == _canon(ground_truth) else float(format_score)


# ---------------------------------------------------------------- math, lenient


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``. None when there is no complete box.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # "\boxed 5": the argument runs to the next "$" or space
        rest = text[i + 1 :]
        return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


_TEXT_RE = re.compile(r"\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}")


def normalize_math_answer(answer: str) -> str:
    """A canonical spelling of a LaTeX answer, for string comparison.

    Removes spaces, ``\\left``/``\\right``, ``\\!``, ``$``, degrees (``^\\circ``), percent signs,
    trailing units in ``\\text{...}``, a trailing ``.``, a leading ``x =``; turns ``dfrac``/``tfrac``
    into ``frac``, ``\\frac12`` into ``\\frac{1}{2}``, ``\\sqrt2`` into ``\\sqrt{2}``, ``.5`` into
    ``0.5`` and ``1,000`` into ``1000``.
    """
    s = str(answer).strip().replace("\n", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip()
    whole = _TEXT_RE.fullmatch(s)
    if whole:
        s = whole.group(1)
    else:
        s = re.sub(r"\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s.^0-9]*\}\s*$", "", s)  # units
        s = _TEXT_RE.sub(r"\1", s)
    s = s.replace(" ", "").rstrip(".")
    if re.match(r"^[A-Za-z]\w?=", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    if _COMMA_INT_RE.match(s):
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    if s.startswith("{") and s.endswith("}") and lastbrace_matches(s):
        s = s[1:-1]
    return s


def lastbrace_matches(s: str) -> bool:
    """True when the first ``{`` of ``s`` is closed by its last character."""
    depth = 0
    for j, ch in enumerate(s):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return j == len(s) - 1
    return False


def math_value(answer: str) -> Fraction | None:
    """The exact rational value of a normalised answer (``3``, ``-0.25``, ``1/2``, ``\\frac{1}{2}``,
    ``-\\frac{3}{4}``), or None when it is not a plain rational number."""
    s = answer
    sign = 1
    if s.startswith("-"):
        sign, s = -1, s[1:]
    frac = re.fullmatch(r"\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    slash = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
    try:
        match = frac or slash
        if match:
            num, den = match.groups()
            return sign * Fraction(num) / Fraction(den)
        if re.fullmatch(r"\d+(?:\.\d+)?", s):
            return sign * Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def is_math_equiv(answer: str, ground_truth: str) -> bool:
    """True when two LaTeX answers are equal after :func:`normalize_math_answer`, or denote the
    same rational number (``0.5`` = ``\\frac{1}{2}`` = ``1/2``)."""
    a, b = normalize_math_answer(answer), normalize_math_answer(ground_truth)
    if a == b:
        return True
    va, vb = math_value(a), math_value(b)
    return va is not None and va == vb


def math_lenient_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """MATH, leniently (registered as ``math_lenient``; verl's scoring is :func:`math_score`): 1.0
    when the last ``\\boxed{...}`` (or ``\\fbox{...}``) of the response is equivalent to
    ``ground_truth``; unlike verl, ``\\boxed{0.75}`` is right for ``\\frac{3}{4}``.

    Equivalence is :func:`is_math_equiv` (normalised strings, or equal rationals); it needs no
    symbolic algebra, so ``x^2+2x`` and ``2x+x^2`` differ (see the ``math_verify`` plugin for that).
    A ground truth that itself holds a ``\\boxed{}`` is compared by its box. No box -> 0.0.
    """
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if is_math_equiv(answer, truth) else 0.0


# ---------------------------------------------------------------- the rest


def exact_match_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    strip: bool = True,
    case_sensitive: bool = True,
) -> float:
    """1.0 when the response equals ``ground_truth`` (or any item of a list of them), else 0.0.

    ``strip`` ignores surrounding whitespace; ``case_sensitive=False`` compares casefolded text.
    """
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]

    def canon(text: Any) -> str:
        text = str(text)
        text = text.strip() if strip else text
        return text if case_sensitive else text.casefold()

    return 1.0 if canon(solution_str) in {canon(t) for t in truths} else 0.0


_INT = r"(-?\d[\d,]*)"
_ARITHMETIC_FORMS = (
    re.compile(r"####\s*\$?" + _INT),
    re.compile(r"\\boxed\{\s*\$?" + _INT + r"(?:\.0+)?\s*\}"),
    re.compile(r"answer\s+is\s*:?\s*\$?" + _INT, re.IGNORECASE),
)


def parse_final_integer(solution_str: str) -> int | None:
    """The final integer answer of a response, or None.

    Looks, in order, for the last ``#### n``, the last ``\\boxed{n}``, the last "answer is n",
    and falls back to the last integer in the text. Thousands commas are allowed.
    """
    for form in _ARITHMETIC_FORMS:
        found = form.findall(solution_str)
        if found:
            return int(found[-1].replace(",", ""))
    found = re.findall(r"(?<![\d.])" + _INT, solution_str)
    return int(found[-1].replace(",", "")) if found else None


def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, Any]:
    """The demo arithmetic task: ``{"score": 1.0 or 0.0, "parsed": int or None}``.

    ``score`` is 1.0 when :func:`parse_final_integer` of the response equals ``ground_truth`` (an
    int or a string such as ``"1,024"``); ``parsed`` is logged per sample, showing how extra
    fields of a dict result reach the metrics.
    """
    parsed = parse_final_integer(solution_str)
    truth = _canon(ground_truth)
    return {"score": 1.0 if parsed is not None and str(parsed) == truth else 0.0, "parsed": parsed}


def format_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    pattern: str | None = None,
) -> float:
    """1.0 when the whole response (surrounding whitespace aside) matches a regular expression.

    The pattern is ``extra_info["pattern"]`` if present, else the ``pattern`` keyword (set it with
    ``reward.function_kwargs.pattern``). ``.`` matches newlines.

    Raises:
        ValueError: no pattern was given, or it is not a valid regular expression.
    """
    pattern = (extra_info or {}).get("pattern", pattern)
    if pattern is None:
        raise ValueError(
            "format_score needs a regular expression: set extra_info['pattern'] in the data, or "
            "reward.function_kwargs.pattern in the config."
        )
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(
            f"format_score pattern {pattern!r} is not a valid regular expression: {exc}."
        ) from exc
    return 1.0 if regex.fullmatch(solution_str.strip()) else 0.0


# ---------------------------------------------------------------- judge verdicts

_JUDGE_SCORE_RE = re.compile(r"score\s*\**\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_JUDGE_OUT_OF_RE = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out\s+of)\s*10(?![\d.])", re.IGNORECASE)
_JUDGE_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def parse_judge_score(text: str) -> float | None:
    """The 0-10 grade a judge's reply gives, or None when it holds no number.

    Reads, in order: the last ``Score: N`` (any case, ``=`` or ``:``, Markdown bold allowed), the last
    ``N/10`` or ``N out of 10``, the last number anywhere. ``"... Score: 7/10"`` -> 7.0.
    """
    for form in (_JUDGE_SCORE_RE, _JUDGE_OUT_OF_RE, _JUDGE_NUMBER_RE):
        found = form.findall(text)
        if found:
            return float(found[-1])
    return None


def judge_score(
    data_source: Any, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None
) -> float:
    """A judge model's verdict as a reward in [0, 1]: its 0-10 grade (:func:`parse_judge_score`) / 10.

    ``solution_str`` is the judge's reply (``reward.model`` calls it that way), not the policy's
    response. Grades outside 0-10 are clipped; a reply without a number scores 0.0.
    """
    grade = parse_judge_score(solution_str)
    if grade is None:
        return 0.0
    return min(max(grade, 0.0), 10.0) / 10.0


# ---------------------------------------------------------------- dispatch by data_source

_SEARCH_R1_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)

DATA_SOURCES: dict[str, Callable[..., Any]] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_dapo_score,
    "math_dapo": math_dapo_score,
    "math_dapo_reasoning": math_dapo_score,
    "hiyouga/geometry3k": geo3k_score,
    **dict.fromkeys(_SEARCH_R1_SOURCES, search_r1_score),
    "arithmetic": arithmetic_score,
}
"""data_source -> scoring function, as :func:`default_compute_score` dispatches. Every source verl
0.9.1's ``default_compute_score`` scores with a rule Trellis has gets verl's scorer (``math`` is DAPO
math there, not MATH); ``gsm8k`` (verl's GSM8K scorer) and ``arithmetic`` (the demo) are Trellis's own."""

DATA_SOURCE_PREFIXES: dict[str, Callable[..., Any]] = {"aime": math_dapo_score}
"""data_source prefix -> scoring function, for a source :data:`DATA_SOURCES` does not name
(verl scores every ``aime*`` source as DAPO math)."""


def scorer_for(data_source: Any) -> Callable[..., Any] | None:
    """The built-in scoring function for ``data_source``, or None."""
    fn = DATA_SOURCES.get(data_source)
    if fn is None and isinstance(data_source, str):
        fn = next((f for p, f in DATA_SOURCE_PREFIXES.items() if data_source.startswith(p)), None)
    return fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict[str, Any]:
    """Score with the built-in function for ``data_source`` (see :data:`DATA_SOURCES` and
    :data:`DATA_SOURCE_PREFIXES`), which gives verl 0.9.1's score for verl's data sources.

    Used when ``reward.function`` is null; ``kwargs`` go to the chosen function (e.g. ``method`` to
    the GSM8K scorer).

    Raises:
        UnknownDataSourceError: ``data_source`` has no built-in scorer; the message lists the known
            ones and says how to choose a function explicitly.
    """
    fn = scorer_for(data_source)
    if fn is None:
        prefixes = ", ".join(f"{p}*" for p in DATA_SOURCE_PREFIXES)
        raise UnknownDataSourceError(
            f"No built-in reward function for data_source {data_source!r}. Known data sources: "
            f"{', '.join(DATA_SOURCES)}, {prefixes}. Set reward.function to a registered name "
            "(e.g. 'exact_match'), 'package.module:fn' or './file.py:fn', or fix the data's "
            "reward_fn_key column."
        )
    return fn(
        data_source=data_source,
        solution_str=solution_str,
        ground_truth=ground_truth,
        extra_info=extra_info,
        **kwargs,
    )

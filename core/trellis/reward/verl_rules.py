"""verl's rule-based scorers, re-implemented so that a recipe ported from verl trains on the same reward.

Each function here gives, for every input verl 0.9.1's ``verl.utils.reward_score`` accepts, the score
verl gives: the same answer extraction (including verl's clipping of long responses), the same string
normalisation, the same format score and the same kind of result (a float, or for ``math_dapo`` a dict
``{"score", "acc", "pred"}``). They were written from verl 0.9.1's ``gsm8k.py``, ``math_reward.py``,
``math_dapo.py``, ``geo3k.py`` and ``search_r1_like_qa_em.py``, and, for geo3k, from ``mathruler`` 0.1.0
(``grader.py``, ``math_normalize.py``), which verl imports there.

Where Trellis differs, on inputs verl does not handle, it says so in the function's docstring:

- a ground truth that is not a string (an ``int`` from a JSON file, a numpy scalar) is compared as
  ``str(ground_truth)``; verl compares the object itself, so such a sample can never be right there;
- where verl fails an ``assert`` on a bad argument, Trellis raises :class:`ValueError`;
- geo3k's LaTeX-to-text step (``pylatexenc`` in ``mathruler``) is a built-in subset, see
  :func:`latex_to_text`.

Nothing here is imported at module import beyond the standard library; the geo3k grader imports
``sympy`` (a dependency of torch) the first time it needs symbolic comparison.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import string
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any


def _text(ground_truth: Any) -> str | None:
    """A ground truth as verl's scorers expect it: a string (None stays None)."""
    if ground_truth is None or isinstance(ground_truth, str):
        return ground_truth
    return str(ground_truth)


# ====================================================================== gsm8k (verl gsm8k.py)

GSM8K_CLIP_CHARS = 300
"""verl reads only the last 300 characters of a GSM8K response."""

_GSM8K_HASH_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER_RUN = re.compile(r"-?[0-9.,]+")


def extract_gsm8k_answer_verl(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K scorer reads from a response, unnormalised, or None.

    Only the last :data:`GSM8K_CLIP_CHARS` characters are searched. ``strict``: the run of digits,
    ``.``, ``,`` (optionally after ``-``) that follows the last ``"#### "`` (one space, exactly), with
    its commas and ``$`` removed. ``flexible``: the last run of digits, ``.`` and ``,`` anywhere,
    commas kept, skipping runs that are just ``"."``; when every run is ``"."`` the first one is
    returned (verl's loop leaves its variable there).

    Raises:
        ValueError: ``method`` is neither ``strict`` nor ``flexible``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}.")
    tail = solution_str[-GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_HASH_ANSWER.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    runs = _GSM8K_NUMBER_RUN.findall(tail)
    if not runs:
        return None
    for run in reversed(runs):
        if run not in ("", "."):
            return run
    return runs[0]


def gsm8k_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K scored as verl scores ``openai/gsm8k``: ``score`` when the extracted answer
    (:func:`extract_gsm8k_answer_verl`) equals the ground truth as a string, ``format_score`` when an
    answer was found but differs, 0.0 when none was found.

    There is no numeric normalisation: ``#### 2652.00``, ``#### $2652`` and ``####2652`` all score 0
    against ``"2652"``. A non-string ground truth is compared as ``str(ground_truth)``.

    Raises:
        ValueError: unknown ``method``.
    """
    answer = extract_gsm8k_answer_verl(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == _text(ground_truth) else float(format_score)


# ====================================================================== MATH (verl math_reward.py)


def last_boxed_verl(text: str) -> str | None:
    """The last box of a response as verl's MATH scorer finds it, wrapper included, or None.

    When the text holds ``"\\boxed "`` (with a space) anywhere, that form wins: ``"\\boxed "`` plus
    the text after its last occurrence up to the next ``$``. Otherwise: from the last ``\\boxed`` (or,
    when there is none, the last ``\\fbox``) to the brace that closes the first ``{`` after it. None
    when there is no box or its braces never close.
    """
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start : end + 1]
    return None


def _unbox_verl(boxed: str) -> str | None:
    """The inside of a box found by :func:`last_boxed_verl`; None where verl's ``remove_boxed``
    fails its check (a ``\\fbox``, or ``\\boxed`` not followed by ``{``)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed ") :] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


class _Unnormalisable(Exception):
    """Where verl's string normalisation raises (and its caller falls back to a raw comparison)."""


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; as in the Hendrycks MATH code."""
    pieces = s.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if not piece:
            raise _Unnormalisable("\\frac at the end")
        if piece[0] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return s
        first, second, rest = piece[0], piece[1], piece[2:]
        if second != "{":
            out += "{" + first + "}{" + second + "}" + rest
        else:
            out += "{" + first + "}" + second + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are plain integers written canonically."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{numerator}/{denominator}":
        return s
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _remove_right_units(s: str) -> str:
    """Everything before ``"\\text{ "`` (a unit, in the MATH data); two of them cannot be normalised."""
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _Unnormalisable("more than one \\text{ ")
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character)."""
    if "\\sqrt" not in s:
        return s
    pieces = s.split("\\sqrt")
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            raise _Unnormalisable("\\sqrt at the end")
        out += "\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:]
    return out


def hendrycks_normalize(s: str, *, percent: str = "verl") -> str:
    """The Hendrycks MATH answer normalisation, as verl's ``math_reward.strip_string`` does it
    (``percent="verl"``: removes ``\\\\%`` and ``\\%``) or as mathruler's ``math_normalize`` does it
    (``percent="mathruler"``: removes ``\\%`` and every ``%``).

    Raises:
        _Unnormalisable: where the original raises (a trailing ``\\sqrt`` or ``\\frac``, two
            ``"\\text{ "``); its callers then compare the raw strings.
    """
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    if percent == "verl":
        s = s.replace("\\\\%", "").replace("\\%", "")
    else:
        s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> " 3"
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv_verl(answer: str | None, ground_truth: str | None) -> bool:
    """verl's MATH equivalence: equal after :func:`hendrycks_normalize`, or, where that cannot
    normalise one of them, equal as written. Two Nones are equal; one None is not."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    try:
        return hendrycks_normalize(answer) == hendrycks_normalize(ground_truth)
    except _Unnormalisable:
        return answer == ground_truth


def math_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """MATH scored as verl scores ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval`` and
    ``HuggingFaceH4/MATH-500``: 1.0 when the last box (:func:`last_boxed_verl`) holds an answer
    :func:`is_equiv_verl` to the ground truth, else 0.0.

    Plain string equivalence after normalisation: ``\\boxed{0.75}`` is not ``\\frac{3}{4}`` (but
    ``\\boxed{0.5}`` is ``\\frac{1}{2}``, a special case of the normalisation), ``\\fbox{12}`` and a
    box cut off before its closing brace score 0. A non-string ground truth is compared as
    ``str(ground_truth)``.
    """
    boxed = last_boxed_verl(solution_str)
    if boxed is None:
        return 0.0
    answer = _unbox_verl(boxed)
    if answer is None:
        return 0.0
    return 1.0 if is_equiv_verl(answer, _text(ground_truth)) else 0.0


# ====================================================================== DAPO (verl math_dapo.py)

DAPO_CLIP_CHARS = 300
"""verl's DAPO scorer reads only the last 300 characters of a response."""

DAPO_BOX_WINDOW = 100
"""... and looks for a ``\\boxed{}`` only in the last 100 of those (or after a pause token)."""

_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_DAPO_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_DAPO_INVALID = "[INVALID]"


def normalize_final_answer(answer: str) -> str:
    """verl's DAPO (Minerva) normalisation of a final answer.

    Keeps what follows the last ``=``; drops articles, spaces, ``\\$`` and a fixed list of unit words
    and LaTeX spacing (removals, in order, are plain substring deletions: ``"cm"`` goes from inside
    any word); keeps only the first ``$...$`` math span; unwraps ``\\text{}``, ``\\textbf{}``,
    ``\\overline{}`` and ``\\boxed{}``; writes ``\\frac12`` as ``\\frac{1}{2}`` and ``\\sqrt2`` as
    ``\\sqrt{2}``; removes thousands commas from a plain integer; strips the ends.
    """
    s = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        s = s.replace(old, new)
    for gone in _DAPO_REMOVED:
        s = s.replace(gone, "")
    s = re.sub(r"(.*?)\$(.*?)\$(.*)", r"$\2$", s)
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\textbf\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\overline\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _dapo_last_box(text: str) -> str | None:
    """The inside of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : end]
    return None


def _dapo_box_check(
    solution_str: str, ground_truth: str, pause_tokens_index: list[int] | None
) -> tuple[bool, str | None]:
    """verl's strict box check: the last box in the final :data:`DAPO_BOX_WINDOW` characters (or
    from 100 before the last pause token) equals the ground truth exactly, as written."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {pause_tokens_index!r}.")
        window = solution_str[pause_tokens_index[-1] - DAPO_BOX_WINDOW :]
    else:
        window = solution_str[-DAPO_BOX_WINDOW:]
    boxed = _dapo_last_box(window)
    return boxed == ground_truth, boxed


def math_dapo_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """DAPO math scored as verl 0.9.1 scores ``math_dapo``, ``math``, ``math_dapo_reasoning`` and
    ``aime*``: ``{"score": 1.0 or -1.0, "acc": bool, "pred": str or None}``.

    Only the last :data:`DAPO_CLIP_CHARS` characters count. The answer is the last ``Answer: ...``
    line (any case), compared with the ground truth after :func:`normalize_final_answer`; ``pred`` is
    the normalised answer. With no such line, the last ``\\boxed{...}`` in the final 100 characters
    is compared with the ground truth exactly as written (no normalisation): ``\\boxed{1,000}`` is
    wrong for ``1000``. With neither, ``pred`` is ``"[INVALID]"``. ``strict_box_verify`` uses only the
    box check (``pred`` None without a box). A wrong or missing answer scores -1.0.

    Raises:
        ValueError: ``ground_truth`` is None, or ``pause_tokens_index`` does not hold 4 indices.
    """
    truth = _text(ground_truth)
    if truth is None:
        raise ValueError("math_dapo needs a ground truth, got None.")
    tail = solution_str[-DAPO_CLIP_CHARS:]
    pred: str | None
    if strict_box_verify:
        correct, pred = _dapo_box_check(tail, truth, pause_tokens_index)
    else:
        lines = _DAPO_ANSWER_LINE.findall(tail)
        pred = normalize_final_answer(lines[-1] if lines else _DAPO_INVALID)
        correct = pred == normalize_final_answer(truth)
        if pred == _DAPO_INVALID:
            box_correct, box_pred = _dapo_box_check(tail, truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ====================================================================== geo3k (verl geo3k.py + mathruler)

_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def extract_boxed_content(text: str) -> str:
    """mathruler's answer extraction: the stripped inside of the last ``\\boxed{...}``; the string
    ``"None"`` when there is no box or it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    content = text[start + len("\\boxed{") :]
    depth = 0
    for i, ch in enumerate(content):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if depth == -1:
            return content[:i].strip()
    return "None"


def _mathd_normalize(answer: str) -> str:
    """mathruler's ``math_normalize.normalize_answer``: strip, unwrap a whole ``\\text{...}``, then
    the Hendrycks normalisation (left as it was where that fails)."""
    answer = answer.strip()
    whole_text = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if whole_text is not None:
        answer = whole_text.group("text").strip()
    try:
        return hendrycks_normalize(answer, percent="mathruler")
    except _Unnormalisable:
        return answer


_UNITS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
)
_UNIT_RES = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _strip_thousands_commas(expr: str) -> str:
    """``1,234,567`` -> ``1234567``, leaving tuple commas (``(1,2)``) alone."""
    pattern = re.compile(r"(\d),(\d\d\d)($|\D)")
    while True:
        stripped = pattern.sub(r"\1\2\3", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(_strip_thousands_commas(text)))
    except ValueError:
        return False


def _parse_latex(expr: str) -> str:
    """mathruler's LaTeX-to-plain-text step, ahead of sympy: ``\\frac{a}{b}`` -> ``a/b``,
    ``\\sqrt{x}`` -> ``sqrt(x)``, ``\\pi`` -> ``pi``, ``\\cdot`` and ``\\times`` -> ``*`` ..."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex_to_text(expr)
    for symbol, word in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, word)
    return expr.strip()


def _mathruler_normalize(expr: str) -> str:
    """mathruler's ``_normalize``: units, ``$``, ``%`` and words like "million" handled, LaTeX turned
    into plain text, spaces and braces removed, lower case, integers written canonically."""
    whole_text = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if whole_text is not None:
        expr = whole_text.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_RES:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        with contextlib.suppress(_LatexError):  # mathruler keeps the LaTeX where conversion fails
            expr = _parse_latex(expr)
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_allowed(expr: str) -> bool:
    """mathruler declines to hand sympy more than two unknown letters, or powers that may hang it."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^", expr) is None and re.search(r"\^[0-9][0-9]+", expr) is None


def _equal_under_sympy(truth: str, given: str) -> bool:
    """True when sympy simplifies ``(truth)-(given)`` to 0 (implicit multiplication allowed)."""
    expr = f"({truth})-({given})"
    if not _sympy_allowed(expr):
        return False
    try:
        sympy = importlib.import_module("sympy")  # untyped; a dependency of torch
        sympy_parser = importlib.import_module("sympy.parsing.sympy_parser")
        transformations = (
            *sympy_parser.standard_transformations,
            sympy_parser.implicit_multiplication_application,
        )
        difference = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
        return bool(sympy.simplify(difference) == 0)
    except Exception:  # mathruler counts any failure to parse or simplify as "not equal"
        return False


def _split_tuple(expr: str) -> list[str]:
    """The elements of ``(a,b)``/``[a,b)``-style tuples and intervals, else ``[expr]``."""
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    inner = expr[1:-1]
    bracketed = len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets
    if bracketed and not any(b in inner for b in brackets):
        return [element.strip() for element in inner.split(",")]
    return [expr]


def _is_frac(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """mathruler's grader: equal after the Hendrycks normalisation, or after its own normalisation, or
    element by element (tuples and intervals) where sympy finds the difference 0. Unreduced fractions
    must match exactly, and an integer ground truth needs an integer answer."""
    if given_answer is None or ground_truth is None:
        return False
    if _mathd_normalize(ground_truth) == _mathd_normalize(given_answer):
        return True
    truth, given = _mathruler_normalize(ground_truth), _mathruler_normalize(given_answer)
    if truth == given:
        return True
    if not given:
        return False
    truth_elements, given_elements = _split_tuple(truth), _split_tuple(given)
    if len(truth_elements) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False
    if len(truth_elements) != len(given_elements):
        return False
    for truth_element, given_element in zip(truth_elements, given_elements, strict=True):
        if _is_frac(truth_element) and _is_frac(given_element):
            correct = truth_element == given_element
        elif _str_is_int(truth_element) != _str_is_int(given_element):
            correct = False
        else:
            correct = _equal_under_sympy(truth_element, given_element)
        if not correct:
            return False
    return True


def geo3k_format_ok(solution_str: str) -> bool:
    """verl's geo3k format check: ``<think>...</think>`` and then a ``\\boxed{...}``, the whole
    response matching (``.`` spans newlines)."""
    return _GEO3K_FORMAT.fullmatch(solution_str) is not None


def geo3k_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    use_boxed: bool = True,
    format_score: float = 0.1,
) -> float:
    """Geometry3K scored as verl scores ``hiyouga/geometry3k``:
    ``(1 - format_score) * accuracy + format_score * format``.

    accuracy is 1.0 when :func:`grade_answer` accepts the last box's content
    (:func:`extract_boxed_content`; the whole response with ``use_boxed=False``), format is 1.0 when
    :func:`geo3k_format_ok`. With the default 0.1: 1.0 right and well formed, 0.9 right without the
    ``<think>`` block, 0.1 wrong but well formed, 0.0 otherwise. A non-string ground truth is compared
    as ``str(ground_truth)``.
    """
    answer = extract_boxed_content(solution_str) if use_boxed else solution_str
    accuracy = 1.0 if grade_answer(answer, _text(ground_truth)) else 0.0
    well_formed = 1.0 if geo3k_format_ok(solution_str) else 0.0
    return (1.0 - format_score) * accuracy + format_score * well_formed


# ---------------------------------------------------------------- LaTeX to text (pylatexenc's subset)


class _LatexError(Exception):
    """The conversion failed where pylatexenc fails (mathruler then keeps the LaTeX as it was)."""


_SYMBOLS: dict[str, str] = {
    "pi": "π",
    "infty": "∞",
    "cup": "∪",
    "cap": "∩",
    "cdot": "·",
    "times": "×",
    "circ": "∘",
    "angle": "∠",
    "pm": "±",
    "mp": "∓",
    "le": "≤",
    "leq": "≤",
    "ge": "≥",
    "geq": "≥",
    "neq": "≠",
    "approx": "≈",
    "sim": "∼",
    "cong": "≅",
    "perp": "⊥",
    "parallel": "∥",
    "div": "÷",
    "ldots": "…",
    "dots": "…",
    "cdots": "⋯",
    "prime": "'",
    "in": "∈",
    "notin": "∉",
    "subset": "⊂",
    "subseteq": "⊆",
    "emptyset": "∅",
    "varnothing": "∅",
    "to": "→",
    "rightarrow": "→",
    "leftarrow": "←",
    "Rightarrow": "⇒",
    "ast": "∗",
    "star": "⋆",
    "bullet": "∙",
    "quad": "  ",
    "qquad": "    ",
    "mid": "|",
    "vert": "|",
    "lvert": "|",
    "rvert": "|",
    "langle": "⟨",
    "rangle": "⟩",
    "lfloor": "⌊",
    "rfloor": "⌋",
    "lceil": "⌈",
    "rceil": "⌉",
    "sum": "∑",
    "int": "∫",
    "partial": "∂",
    "nabla": "∇",
    "forall": "∀",
    "exists": "∃",
    "oplus": "⊕",
    "odot": "⊙",
    "equiv": "≡",
    "propto": "∝",
    "therefore": "∴",
    "because": "∵",
    "blacksquare": "▪",
    "square": "□",
    "dagger": "†",
    "ell": "ℓ",
    "hbar": "ħ",
    "aleph": "ℵ",
    "textdegree": "°",
    "i": "ı",
    "j": "ȷ",
    "o": "ø",
    "l": "ł",
    "ss": "ß",
    "ae": "æ",
    "aa": "å",
    "oe": "œ",
    "AA": "Å",
    **{name: name for name in ("sin", "cos", "tan", "log", "ln", "exp", "min", "max", "lim")},
    **{name: name for name in ("arcsin", "arccos", "arctan")},
    "alpha": "α",
    "beta": "β",
    "gamma": "γ",
    "delta": "δ",
    "epsilon": "ϵ",
    "varepsilon": "ε",
    "zeta": "ζ",
    "eta": "η",
    "theta": "θ",
    "vartheta": "ϑ",
    "iota": "ι",
    "kappa": "κ",
    "lambda": "λ",
    "mu": "μ",
    "nu": "ν",
    "xi": "ξ",
    "omicron": "ο",
    "rho": "ρ",
    "sigma": "σ",
    "tau": "τ",
    "upsilon": "υ",
    "phi": "ϕ",
    "varphi": "φ",
    "chi": "χ",
    "psi": "ψ",
    "omega": "ω",
    "Gamma": "Γ",
    "Delta": "Δ",
    "Theta": "Θ",
    "Lambda": "Λ",
    "Xi": "Ξ",
    "Pi": "Π",
    "Sigma": "Σ",
    "Upsilon": "Υ",
    "Phi": "Φ",
    "Psi": "Ψ",
    "Omega": "Ω",
}
"""Macros without arguments that pylatexenc writes as a character (or word); any other macro
without a rule here is dropped, and what follows it is read as ordinary text."""

_CONTROL_SYMBOLS = {
    "{": "{",
    "}": "}",
    "%": "%",
    "$": "$",
    "&": "&",
    "_": "_",
    "#": "#",
    "-": "\xad",
    ",": " ",
    ";": " ",
    ":": " ",
    " ": " ",
    "!": "",
    "\\": "\n",
}
_ACCENT_SYMBOLS = {
    "`": "\u0300",
    "'": "\u0301",
    "^": "\u0302",
    '"': "\u0308",
    "~": "\u0303",
    "=": "\u0304",
    ".": "\u0307",
}
_LIGATURES = (("---", "—"), ("--", "–"), ("``", "“"), ("''", "”"))
_ONE_ARG_KEPT = frozenset(
    {"overline", "underline", "widehat", "overrightarrow", "text", "mathrm", "textbf", "textrm"}
    | {"textit", "emph", "hbox", "operatorname", "boxed", "fbox"}
)
_ONE_ARG_TEMPLATED = frozenset({"overline", "underline", "widehat", "overrightarrow"})
"""Of those, the ones pylatexenc writes as ``%s`` when their argument is missing."""
_ONE_ARG_DROPPED = frozenset(("mbox", "texttt", "textsf"))
_COMBINING = {
    "vec": "\u20d7",
    "hat": "\u0302",
    "bar": "\u0305",
    "tilde": "\u0303",
    "dot": "\u0307",
    "u": "\u0306",
    "v": "\u030c",
    "H": "\u030b",
    "c": "\u0327",
    "d": "\u0323",
    "b": "\u0331",
    "r": "\u030a",
}
_ALPHABETS = {
    "mathbf": "BOLD",
    "mathbb": "DOUBLE-STRUCK",
    "mathcal": "SCRIPT",
    "mathit": "ITALIC",
    "mathsf": "SANS-SERIF",
    "mathtt": "MONOSPACE",
    "mathfrak": "FRAKTUR",
}


_LETTERLIKE = {  # letters of the mathematical alphabets that Unicode encodes elsewhere
    ("SCRIPT", "B"): "ℬ",
    ("SCRIPT", "E"): "ℰ",
    ("SCRIPT", "F"): "ℱ",
    ("SCRIPT", "H"): "ℋ",
    ("SCRIPT", "I"): "ℐ",
    ("SCRIPT", "L"): "ℒ",
    ("SCRIPT", "M"): "ℳ",
    ("SCRIPT", "R"): "ℛ",
    ("SCRIPT", "e"): "ℯ",
    ("SCRIPT", "g"): "ℊ",
    ("SCRIPT", "o"): "ℴ",
    ("DOUBLE-STRUCK", "C"): "ℂ",
    ("DOUBLE-STRUCK", "H"): "ℍ",
    ("DOUBLE-STRUCK", "N"): "ℕ",
    ("DOUBLE-STRUCK", "P"): "ℙ",
    ("DOUBLE-STRUCK", "Q"): "ℚ",
    ("DOUBLE-STRUCK", "R"): "ℝ",
    ("DOUBLE-STRUCK", "Z"): "ℤ",
    ("FRAKTUR", "C"): "ℭ",
    ("FRAKTUR", "H"): "ℌ",
    ("FRAKTUR", "I"): "ℑ",
    ("FRAKTUR", "R"): "ℜ",
    ("FRAKTUR", "Z"): "ℨ",
    ("ITALIC", "h"): "ℎ",
}


def _styled(alphabet: str, text: str) -> str:
    """The ASCII letters of ``text`` in a Unicode mathematical alphabet (digits and the rest kept)."""
    out = []
    for ch in text:
        if not (ch.isascii() and ch.isalpha()):
            out.append(ch)
        elif (alphabet, ch) in _LETTERLIKE:
            out.append(_LETTERLIKE[alphabet, ch])
        else:
            case = "CAPITAL" if ch.isupper() else "SMALL"
            out.append(unicodedata.lookup(f"MATHEMATICAL {alphabet} {case} {ch.upper()}"))
    return "".join(out)


class _LatexReader:
    """A small recursive reader over LaTeX source, writing plain text as pylatexenc does by default."""

    def __init__(self, source: str) -> None:
        self.s = source
        self.i = 0

    def text(self, stop: str | None = None) -> str:
        """Plain text up to the end, or up to ``stop`` (consumed)."""
        out: list[str] = []
        while self.i < len(self.s):
            if stop is not None and self.s.startswith(stop, self.i):
                self.i += len(stop)
                break
            ch = self.s[self.i]
            if ch == "\\":
                out.append(self._macro())
            elif ch == "}":
                self.i += 1  # a stray closing brace is dropped
            elif ch == "%":  # a comment, to the end of the line
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            elif ch == "$":
                self.i += 1
            else:
                out.append(self._token())
        return "".join(out)

    def _token(self) -> str:
        """One group, ligature or character of text."""
        ch = self.s[self.i]
        if ch == "{":
            self.i += 1
            return self.text(stop="}")
        for ligature, written in _LIGATURES:
            if self.s.startswith(ligature, self.i):
                self.i += len(ligature)
                return written
        self.i += 1
        return {"~": "\xa0", "&": "   "}.get(ch, ch)

    def _skip_spaces(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n":
            self.i += 1

    def _argument(self) -> str | None:
        """The next argument: a ``{group}``, a ligature or character, or a macro taken alone
        (pylatexenc gives a macro that is another's argument no arguments of its own); ``""``
        before a ``}``; None at the end of the text."""
        self._skip_spaces()
        if self.i >= len(self.s) or self.s[self.i :] == "\\":  # a lone final backslash ends it too
            return None
        ch = self.s[self.i]
        if ch == "\\":
            return self._macro(bare=True)
        if ch == "}":  # pylatexenc reads an empty argument there
            return ""
        return self._token()

    def _skip_argument(self) -> None:
        """Pass over the next argument without writing it (what pylatexenc discards, it never
        renders, so it cannot fail there)."""
        self._skip_spaces()
        if self.i >= len(self.s) or self.s[self.i] == "}":
            return
        if self.s[self.i] == "{":
            depth = 0
            while self.i < len(self.s):
                depth += {"{": 1, "}": -1}.get(self.s[self.i], 0)
                self.i += 2 if self.s[self.i] == "\\" else 1
                if depth == 0:
                    return
        elif self.s[self.i] == "\\":
            self.i += 1
            if self.i < len(self.s) and not self.s[self.i].isalpha():
                self.i += 1
            while self.i < len(self.s) and self.s[self.i].isalpha():
                self.i += 1
        else:
            self.i += 1

    def _optional(self) -> None:
        """Skip an optional ``[...]`` argument (pylatexenc writes ``\\sqrt[3]{8}`` as ``√(8)``).

        Raises:
            _LatexError: the ``[`` is never closed.
        """
        self._skip_spaces()
        if self.i < len(self.s) and self.s[self.i] == "[":
            end = self._closing_bracket()
            if end < 0:
                raise _LatexError("an optional argument without its ]")
            self.i = end + 1

    def _closing_bracket(self) -> int:
        """Where the ``]`` closing the ``[`` at the cursor is (nested pairs skipped), or -1."""
        depth = 0
        for j in range(self.i, len(self.s)):
            depth += {"[": 1, "]": -1}.get(self.s[j], 0)
            if depth == 0:
                return j
        return -1

    def _macro(self, bare: bool = False) -> str:
        """The text of the macro at the cursor; ``bare``: without reading any argument."""
        self.i += 1  # the backslash
        if self.i >= len(self.s):
            return ""
        if not self.s[self.i].isalpha():
            ch = self.s[self.i]
            self.i += 1
            if ch in _ACCENT_SYMBOLS:
                return self._with_mark(_ACCENT_SYMBOLS[ch], bare)
            if ch == "\\" and not bare:  # a line break, with an optional [spacing]
                self._skip_spaces()
                if self.i < len(self.s) and self.s[self.i] == "[":
                    end = self._closing_bracket()
                    self.i = len(self.s) if end < 0 else end + 1
                return "\n"
            if ch in "[(" and not bare:  # display / inline math, up to its closing delimiter
                inner = self.text(stop="\\" + ("]" if ch == "[" else ")"))
                return "\n    " + inner + "\n" if ch == "[" else inner
            return _CONTROL_SYMBOLS.get(ch, "")
        start = self.i
        while self.i < len(self.s) and self.s[self.i].isalpha():
            self.i += 1
        name = self.s[start : self.i]
        self._skip_spaces()
        if name in ("frac", "nicefrac", "textfrac"):
            mark = self.i
            numerator = None if bare else self._argument()
            denominator = None if numerator is None else self._argument()
            if numerator is None or denominator is None:  # pylatexenc writes its template
                self.i = mark
                return "%s/%s"
            return f"{numerator}/{denominator}"
        if name == "sqrt":
            if not bare:
                self._optional()
            radicand = None if bare else self._argument()
            if radicand is None:
                raise _LatexError("\\sqrt without an argument")
            return f"√({radicand})"
        if name in ("begin", "end") and not bare:  # an environment: its content is read as text
            environment = self._argument() if self.s.startswith("{", self.i) else None
            if name == "begin" and environment == "array":
                self._skip_argument()  # the column specification
            return ""
        if name in _COMBINING:
            return self._with_mark(_COMBINING[name], bare)
        if name in _ONE_ARG_DROPPED:
            if not bare:
                self._skip_argument()
            return ""
        if name in _ONE_ARG_KEPT or name in _ALPHABETS:
            mark = self.i
            argument = None if bare else self._argument()
            if argument is None:
                self.i = mark
                return "%s" if name in _ONE_ARG_TEMPLATED else ""
            return _styled(_ALPHABETS[name], argument) if name in _ALPHABETS else argument
        return _SYMBOLS.get(name, "")

    def _with_mark(self, mark: str, bare: bool) -> str:
        """An accent: each character of its argument followed by the combining ``mark``, composed
        where Unicode can; a space and the mark when the argument is missing."""
        position = self.i
        argument = None if bare else self._argument()
        if argument is None:
            self.i = position
            return " " + mark
        return unicodedata.normalize("NFC", "".join(ch + mark for ch in argument.strip()))


def latex_to_text(source: str) -> str:
    """LaTeX as plain text, the way mathruler's ``pylatexenc.latex2text`` call writes it, for what
    geometry answers hold: groups unwrapped, ``\\frac{a}{b}`` -> ``a/b`` (no parentheses, as
    pylatexenc), ``\\sqrt[n]{x}`` -> ``√(x)``, ``\\pi`` -> ``π`` and the other symbols of
    :data:`_SYMBOLS`, ``\\text``-like macros -> their argument, ``\\,`` -> space, ``\\left``,
    ``\\right``, ``\\displaystyle`` and unknown macros -> nothing, ``%`` starts a comment.

    A subset of pylatexenc 2.11's defaults, checked against it on random strings of the macros above
    (unbalanced braces, missing arguments, accents and math alphabets included): it knows more
    macros, and lays out environments (``pmatrix`` as ``[ 1 2; 3 4 ]``, ``align`` as display math)
    where this keeps their content as text; such inputs may convert differently.

    Raises:
        _LatexError: where pylatexenc raises (``\\sqrt`` without an argument).
    """
    return _LatexReader(source).text()


# ================================================================ search-R1 (verl search_r1_like_qa_em.py)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_qa_answer(text: str) -> str:
    """SQuAD-style answer normalisation: lower case, no ASCII punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_qa_answer(solution_str: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` (across lines), or None."""
    found = _ANSWER_TAG.findall(solution_str)
    return found[-1].strip() if found else None


def _targets(ground_truth: Any) -> list[str]:
    targets = ground_truth["target"] if isinstance(ground_truth, Mapping) else ground_truth
    if isinstance(targets, str):
        return [targets]
    if isinstance(targets, Iterable):
        return [t if isinstance(t, str) else str(t) for t in targets]
    return [str(targets)]


def search_r1_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Search-R1 QA scored as verl scores ``searchR1_nq``, ``searchR1_hotpotqa`` and the other
    ``searchR1_*`` sources (exact match): ``score`` when the last ``<answer>...</answer>`` equals one of
    ``ground_truth["target"]`` after :func:`normalize_qa_answer`, ``score / 4`` when it does but the
    response holds more than 10 ``<answer>`` or more than 10 ``</answer>`` tags, ``format_score`` for a
    wrong answer, 0.0 without one. ``method`` is accepted and unused, as in verl.

    ``ground_truth`` is verl's ``{"target": [...]}`` (a string or a list/array of strings); Trellis
    also takes the targets themselves, which verl rejects.
    """
    answer = extract_qa_answer(solution_str)
    if answer is None:
        return 0.0
    normalized = normalize_qa_answer(answer)
    if not any(normalize_qa_answer(t) == normalized for t in _targets(ground_truth)):
        return float(format_score)
    if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:
        return float(score) / 4
    return float(score)

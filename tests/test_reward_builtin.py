"""trellis.reward.builtin: the built-in scoring functions and the data_source dispatcher.

The verl-identical scorers (trellis.reward.verl_rules) are pinned with hand-computed cases, each
commented with why verl 0.9.1 (verl/utils/reward_score/*.py, mathruler 0.1.0 for geo3k) scores it so.
"""

from __future__ import annotations

import numpy as np
import pytest

from trellis.reward import verl_rules
from trellis.reward.builtin import (
    DATA_SOURCE_PREFIXES,
    DATA_SOURCES,
    UnknownDataSourceError,
    arithmetic_score,
    default_compute_score,
    exact_match_score,
    extract_gsm8k_answer,
    format_score,
    geo3k_score,
    gsm8k_lenient_score,
    gsm8k_score,
    is_math_equiv,
    last_boxed,
    math_dapo_score,
    math_lenient_score,
    math_score,
    normalize_math_answer,
    normalize_number,
    parse_final_integer,
    scorer_for,
    search_r1_score,
)


def score(fn, solution, truth, extra_info=None, **kwargs):
    return fn(data_source="t", solution_str=solution, ground_truth=truth, extra_info=extra_info, **kwargs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,234.50", "1234.5"),
        ("7.0", "7"),
        ("-0", "0"),
        (".5", "0.5"),
        ("12.", "12"),
        ("-3", "-3"),
        ("x", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_gsm8k_lenient_strict_reads_only_the_hash_answer():
    assert score(gsm8k_lenient_score, "12 + 7 = 19. #### 19", "19") == 1.0
    assert score(gsm8k_lenient_score, "#### $1,000.0", "1000") == 1.0
    assert score(gsm8k_lenient_score, "#### 18\nno wait #### 19", "19") == 1.0  # the last one counts
    assert score(gsm8k_lenient_score, "The answer is 19", "19") == 0.0  # no ####
    assert score(gsm8k_lenient_score, "#### 20", "19") == 0.0
    assert score(gsm8k_lenient_score, "#### 20", "19", format_score=0.1) == 0.1
    assert score(gsm8k_lenient_score, "no answer at all", "19", format_score=0.1) == 0.0


def test_gsm8k_lenient_flexible_takes_the_last_number():
    assert score(gsm8k_lenient_score, "The answer is 19", "19", method="flexible") == 1.0
    assert score(gsm8k_lenient_score, "The answer is 19", "19", {"method": "flexible"}) == 1.0
    assert score(gsm8k_lenient_score, "it costs $2,500.00 in total", "2500", method="flexible") == 1.0
    assert score(gsm8k_lenient_score, "19 or maybe 20", "19", method="flexible") == 0.0
    assert extract_gsm8k_answer("a -4 b", "flexible") == "-4"
    with pytest.raises(ValueError, match=r"gsm8k method must be 'strict' or 'flexible', got 'loose'"):
        score(gsm8k_lenient_score, "#### 1", "1", method="loose")


def test_last_boxed_balances_nested_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"so $\boxed 5$") == "5"
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        (r"\frac12", "1/2"),
        (r"-\tfrac{3}{4}", "-0.75"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"10\text{ cm}", "10"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\!5.", "5"),
        ("1,000", "1000"),
        ("x = 3", "3"),
        (r"\text{Monday}", "Monday"),
        (r"\$4.50", "4.5"),
        (".5", "0.5"),
        ("50\\%", "50"),
    ],
)
def test_math_lenient_equivalences(answer, truth):
    assert is_math_equiv(answer, truth)
    assert score(math_lenient_score, f"so the answer is $\\boxed{{{answer}}}$.", truth) == 1.0


def test_math_lenient_differences_and_missing_box():
    assert not is_math_equiv("0.51", r"\frac{1}{2}")
    assert not is_math_equiv(r"\frac{1}{0}", "0")
    assert score(math_lenient_score, r"\boxed{3}", "4") == 0.0
    assert score(math_lenient_score, "the answer is 3", "3") == 0.0
    assert score(math_lenient_score, r"\boxed{2}", r"so \boxed{2}") == 1.0  # a boxed ground truth
    assert normalize_math_answer(r"\sqrt2") == r"\sqrt{2}"


def test_exact_match():
    assert score(exact_match_score, " Paris\n", "Paris") == 1.0
    assert score(exact_match_score, "paris", "Paris") == 0.0
    assert score(exact_match_score, "paris", "Paris", case_sensitive=False) == 1.0
    assert score(exact_match_score, " Paris", "Paris", strip=False) == 0.0
    assert score(exact_match_score, "Lyon", ["Paris", "Lyon"]) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\n#### 7", 7),
        (r"so \boxed{42} and 3 more", 42),
        ("The answer is: 1,024. Checking 5", 1024),
        ("12 + 7 = 19", 19),
        ("#### -5 but \\boxed{6}", -5),  # #### wins over \boxed
        ("no digits", None),
    ],
)
def test_arithmetic_parse_forms(text, expected):
    assert parse_final_integer(text) == expected


def test_arithmetic_returns_score_and_parsed():
    assert score(arithmetic_score, "12 + 7 = 19. The answer is 19", 19) == {"score": 1.0, "parsed": 19}
    assert score(arithmetic_score, "#### 20", "19") == {"score": 0.0, "parsed": 20}
    assert score(arithmetic_score, "I don't know", "19") == {"score": 0.0, "parsed": None}
    assert score(arithmetic_score, "#### 1,024", "1024")["score"] == 1.0


def test_format_pattern_from_extra_info_or_kwarg():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    good = "<think>a\nb</think>\n<answer>3</answer>\n"
    assert score(format_score, good, None, {"pattern": pattern}) == 1.0
    assert score(format_score, good, None, pattern=pattern) == 1.0
    assert score(format_score, "junk " + good, None, pattern=pattern) == 0.0  # full match only
    assert score(format_score, "x", None, {"pattern": "x"}, pattern="y") == 1.0  # extra_info wins
    with pytest.raises(ValueError, match=r"extra_info\['pattern'\].*reward\.function_kwargs\.pattern"):
        score(format_score, "x", None)
    with pytest.raises(ValueError, match=r"pattern '\(' is not a valid regular expression"):
        score(format_score, "x", None, pattern="(")


def test_default_compute_score_dispatches_by_data_source():
    call = dict(solution_str=r"#### 19 \boxed{19}", ground_truth="19")
    assert default_compute_score(data_source="openai/gsm8k", **call) == 1.0
    assert default_compute_score(data_source="lighteval/MATH", **call) == 1.0
    assert default_compute_score(data_source="DigitalLearningGmbH/MATH-lighteval", **call) == 1.0
    assert default_compute_score(data_source="arithmetic", **call) == {"score": 1.0, "parsed": 19}
    assert (
        default_compute_score(data_source="gsm8k", solution_str="19", ground_truth="19", method="flexible")
        == 1.0
    )
    assert {"gsm8k", "math", "arithmetic"} <= set(DATA_SOURCES)


def test_unknown_data_source_lists_known_ones_and_the_fix():
    with pytest.raises(UnknownDataSourceError) as info:
        default_compute_score(data_source="my/dataset", solution_str="x", ground_truth="x")
    message = str(info.value)
    assert "No built-in reward function for data_source 'my/dataset'" in message
    assert "openai/gsm8k, gsm8k, lighteval/MATH" in message
    assert "Set reward.function" in message and "'./file.py:fn'" in message
    assert isinstance(info.value, LookupError)


def test_importing_rewards_does_not_import_torch(python):
    done = python("import sys, trellis.reward, trellis.reward.workers; print('torch' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ============================================================ verl 0.9.1, case by case

# ---------------------------------------------------------------- the strings of issue 21


@pytest.mark.parametrize(
    ("data_source", "solution", "truth"),
    [
        ("openai/gsm8k", "#### $2652", "2652"),  # verl's regex wants a digit right after "#### "
        ("openai/gsm8k", "####2652", "2652"),  # ... and exactly one space after "####"
        ("openai/gsm8k", "#### 2652.00", "2652"),  # "2652.00" != "2652": compared as strings
        ("lighteval/MATH", r"so \boxed{0.75}", r"\frac{3}{4}"),  # no numeric equivalence
        ("lighteval/MATH", r"\fbox{12}", "12"),  # found, but remove_boxed rejects \fbox: 0
    ],
)
def test_the_issue_strings_score_zero_by_default_and_one_leniently(data_source, solution, truth):
    assert default_compute_score(data_source=data_source, solution_str=solution, ground_truth=truth) == 0.0
    lenient = gsm8k_lenient_score if "gsm8k" in data_source else math_lenient_score
    assert score(lenient, solution, truth) == 1.0  # Trellis's earlier scorers, kept under new names


# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("solution", "truth", "kwargs", "expected"),
    [
        ("12 + 7 = 19. #### 19", "19", {}, 1.0),  # the number after "#### " equals the truth
        ("#### 2,652", "2652", {}, 1.0),  # commas are removed from the strict answer
        ("#### 18\nno wait #### 19", "19", {}, 1.0),  # the last "#### " counts
        ("#### 72.", "72", {}, 0.0),  # the run takes the final "." along: "72." != "72"
        ("#### 20", "19", {}, 0.0),  # wrong: format_score, 0.0 by default
        ("#### 20", "19", {"format_score": 0.1}, 0.1),  # ... or the one given
        ("#### 19", "19", {"score": 2.0}, 2.0),  # right: score
        ("The answer is 19", "19", {"format_score": 0.1}, 0.0),  # no "#### ": no answer, 0
        ("#### 19\n" + "and that is all. " * 20, "19", {}, 0.0),  # only the last 300 chars are read
        ("x" * 400 + "#### 19", "19", {}, 1.0),  # ... so a long response is fine if it ends so
        ("The answer is 19", "19", {"method": "flexible"}, 1.0),  # flexible: the last number
        ("it costs 2,500", "2500", {"method": "flexible"}, 0.0),  # flexible keeps commas
        ("so 19.", "19", {"method": "flexible"}, 0.0),  # ... and the trailing period
        ("first. second.", "19", {"method": "flexible", "format_score": 0.5}, 0.5),  # "." is the
        # only run, verl's loop leaves it as the answer: wrong, so format_score
    ],
)
def test_gsm8k_is_verls(solution, truth, kwargs, expected):
    assert score(gsm8k_score, solution, truth, **kwargs) == expected


def test_gsm8k_details():
    assert score(gsm8k_score, "#### 19", 19) == 1.0  # Trellis compares str(ground_truth); verl: 0
    assert verl_rules.extract_gsm8k_answer_verl("#### -1,000.5") == "-1000.5"
    assert verl_rules.extract_gsm8k_answer_verl("no digits", "flexible") is None
    with pytest.raises(ValueError, match=r"gsm8k method must be 'strict' or 'flexible', got 'loose'"):
        score(gsm8k_score, "#### 1", "1", method="loose")
    # the default dispatcher returns verl's float; kwargs reach the scorer
    assert default_compute_score("openai/gsm8k", "it is 5", "5") == 0.0
    assert default_compute_score("openai/gsm8k", "it is 5", "5", method="flexible") == 1.0


# ---------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        (r"so $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}", 1.0),  # equal strings
        (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),  # "a/b" of two integers becomes \frac{a}{b}
        (r"\boxed{\dfrac34}", r"\frac{3}{4}", 1.0),  # dfrac -> frac, \frac34 -> \frac{3}{4}
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),  # the one decimal the normalisation rewrites
        (r"\boxed{0.75}", "3/4", 0.0),  # no other: "0.75" != "\frac{3}{4}"
        (r"\boxed{12\text{ cm}}", "12", 1.0),  # what follows "\text{ " is a unit, dropped
        (r"\boxed{x = 12}", "12", 1.0),  # "x " (2 chars or less) before a single "=" is dropped
        (r"\boxed{50\%}", "50", 1.0),  # \% removed
        (r"\boxed{90^\circ}", "90", 1.0),  # degrees removed
        (r"\boxed{1,000}", "1000", 0.0),  # thousands commas are not
        (r"\boxed{12.0}", "12", 0.0),  # nor a ".0"
        (r"\boxed{1} no, \boxed{2}", "2", 1.0),  # the last box counts
        (r"the answer is \boxed 12$.", "12", 1.0),  # "\boxed " runs to the next "$"
        (r"\boxed{12", "12", 0.0),  # a box cut off before its closing brace: none
        ("the answer is 12", "12", 0.0),  # no box
        (r"\fbox{12}", "12", 0.0),  # \fbox is found but not unboxed: 0
        (r"\boxed{\sqrt}", r"\sqrt", 1.0),  # unnormalisable (trailing \sqrt): raw comparison
        (r"\boxed{\sqrt}", r"\sqrt{}", 0.0),  # ... which fails here
    ],
)
def test_math_is_verls(solution, truth, expected):
    assert score(math_score, solution, truth) == expected


def test_math_sources_dispatch_to_it():
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert DATA_SOURCES[source] is math_score
        assert default_compute_score(source, r"\boxed{7}", "7") == 1.0
    assert score(math_score, r"\boxed{7}", 7) == 1.0  # str(ground_truth); verl compares 7 to "7"


# ---------------------------------------------------------------- DAPO (math_dapo, math, aime*)


def dapo(correct, pred):
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@pytest.mark.parametrize(
    ("solution", "truth", "kwargs", "expected"),
    [
        ("Let me see.\nAnswer: 34", "34", {}, dapo(True, "34")),  # the "Answer:" line
        ("answer : 35", "34", {}, dapo(False, "35")),  # any case; wrong scores -1
        ("Answer: $x = 34$ units", "34", {}, dapo(True, "34")),  # after "=", spaces, "units", "$" go
        ("Answer: 1,000", "1000", {}, dapo(True, "1000")),  # commas of a plain integer go
        ("Answer: 5 students", "5", {}, dapo(True, "5")),  # listed unit words go
        ("Answer: 3\nAnswer: 34", "34", {}, dapo(True, "34")),  # the last line counts
        (r"\boxed{34}" + "\nAnswer: 35", "34", {}, dapo(False, "35")),  # a line beats a box
        (r"so \boxed{34}.", "34", {}, dapo(True, "34")),  # no line: the box, compared as written
        (r"so \boxed{1,000}.", "1000", {}, dapo(False, "1,000")),  # ... so not normalised
        ("no answer here", "34", {}, dapo(False, "[INVALID]")),  # neither
        ("Answer: 34" + "." * 300, "34", {}, dapo(False, "[INVALID]")),  # only the last 300 chars
        (r"\boxed{34}" + "." * 150, "34", {}, dapo(False, "[INVALID]")),  # a box: the last 100
        ("Answer: 34", "34", {"strict_box_verify": True}, dapo(False, None)),  # strict: boxes only
        (r"\boxed{34}", "34", {"strict_box_verify": True}, dapo(True, "34")),
        # with pause tokens, the box is looked for from 100 chars before the last one
        (r"\boxed{34} " + "." * 150, "34", {"pause_tokens_index": [0, 0, 0, 100]}, dapo(True, "34")),
    ],
)
def test_math_dapo_is_verls(solution, truth, kwargs, expected):
    result = score(math_dapo_score, solution, truth, **kwargs)
    assert result == expected and type(result["acc"]) is bool


def test_math_dapo_sources_and_errors():
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime24", "aime_2025", "aime"):
        assert scorer_for(source) is math_dapo_score  # "math" is DAPO math in verl, not MATH
        assert default_compute_score(source, "Answer: 7", "7") == dapo(True, "7")
    assert list(DATA_SOURCE_PREFIXES.items()) == [("aime", math_dapo_score)]
    with pytest.raises(ValueError, match="4 indices"):
        score(math_dapo_score, r"\boxed{1}", "1", strict_box_verify=True, pause_tokens_index=[1])
    with pytest.raises(ValueError, match="needs a ground truth"):
        score(math_dapo_score, "Answer: 1", None)
    assert verl_rules.normalize_final_answer(r"\text{(A)}") == "(A)"
    assert verl_rules.normalize_final_answer(r"\frac12") == r"\frac{1}{2}"


# ---------------------------------------------------------------- geo3k (hiyouga/geometry3k)


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        (r"<think>r</think> \boxed{3}", "3", 1.0),  # right and well formed: 0.9 * 1 + 0.1 * 1
        (r"\boxed{3}", "3", 0.9),  # right, no <think> block: 0.9
        (r"<think>r</think> \boxed{4}", "3", 0.1),  # wrong but well formed: 0.1
        ("3", "3", 0.0),  # no box: the answer is the string "None"
        (r"\boxed{3}<think>r</think>", "3", 0.9),  # the box must follow </think> for the format
        (r"<think>r</think> \boxed{\sqrt{12}}", r"2\sqrt{3}", 1.0),  # sympy: 2*sqrt(3) - sqrt(12) = 0
        (r"<think>r</think> \boxed{\frac{40}{3}}", "40/3", 1.0),  # 40/3 -> \frac{40}{3}
        (r"<think>r</think> \boxed{13.33}", r"\frac{40}{3}", 0.1),  # not equal under sympy
        (r"<think>r</think> \boxed{60^\circ}", "60", 1.0),  # degrees removed
        (r"<think>r</think> \boxed{3.0}", "3", 1.0),  # a float that is an integer -> "3"
        (r"<think>r</think> \boxed{6/4}", "3/2", 0.1),  # unreduced fractions must match exactly
        (r"<think>r</think> \boxed{1.5}", "3/2", 1.0),  # not both fractions: sympy, 3/2 - 1.5 = 0
    ],
)
def test_geo3k_is_verls(solution, truth, expected):
    assert score(geo3k_score, solution, truth) == pytest.approx(expected)


def test_geo3k_details():
    assert DATA_SOURCES["hiyouga/geometry3k"] is geo3k_score
    assert score(geo3k_score, r"<think>r</think> \boxed{3}", 3) == 1.0  # str(ground_truth)
    assert score(geo3k_score, "3", "3", use_boxed=False) == pytest.approx(0.9)  # the whole response
    assert score(geo3k_score, r"\boxed{3}", "3", format_score=0.5) == 0.5
    assert verl_rules.extract_boxed_content(r"a \boxed{ \frac{1}{2} } b") == r"\frac{1}{2}"
    assert verl_rules.extract_boxed_content(r"\boxed{1") == "None"


@pytest.mark.parametrize(
    ("latex", "text"),
    [  # what pylatexenc 2.11 writes, which mathruler hands to sympy
        (r"\frac{40}{3}", "40/3"),
        (r"2\sqrt{3}", "2√(3)"),
        (r"\sqrt[3]{8}", "√(8)"),
        (r"\frac{a+b}{c}", "a+b/c"),  # no parentheses
        (r"\frac 1 2", "1/2"),
        (r"\pi r^{2}", "πr^2"),
        (r"\left(1,2\right)", "(1,2)"),
        (r"\text{cm}", "cm"),
        (r"\mbox{cm}", ""),
        (r"\mathbf{v}", "𝐯"),
        (r"\hat{x}", "x̂"),
        (r"\frac{1}", "%s/%s1"),  # a missing argument: pylatexenc's template
        (r"\sqrt\text{ab}", "√()ab"),  # a macro argument gets no argument of its own
        (r"a\,b", "a b"),
        (r"\foo{3}", "3"),  # unknown macros vanish
    ],
)
def test_latex_to_text_follows_pylatexenc(latex, text):
    assert verl_rules.latex_to_text(latex) == text


def test_latex_to_text_fails_where_pylatexenc_fails():
    with pytest.raises(verl_rules._LatexError):
        verl_rules.latex_to_text(r"\sqrt")


# ---------------------------------------------------------------- search-R1 QA


@pytest.mark.parametrize(
    ("solution", "targets", "kwargs", "expected"),
    [
        ("<answer>Paris</answer>", ["Paris"], {}, 1.0),  # exact match
        ("<answer> The  Paris. </answer>", ["paris"], {}, 1.0),  # case, articles, punctuation go
        ("<answer>the city of Paris</answer>", ["Paris"], {}, 0.0),  # exact, not contained
        ("<answer>Lyon</answer>", ["Paris"], {"format_score": 0.2}, 0.2),  # wrong: format_score
        ("Paris", ["Paris"], {"format_score": 0.2}, 0.0),  # no <answer>: 0
        ("<answer>no</answer> <answer>Paris</answer>", ["Paris"], {}, 1.0),  # the last one counts
        ("<answer>Paris</answer>", np.array(["Rome", "Paris"], dtype=object), {}, 1.0),  # any target
        ("<answer>Paris</answer>", "Paris", {}, 1.0),  # a single string target
        ("<answer>x</answer>" * 10 + "<answer>Paris</answer>", ["Paris"], {}, 0.25),  # > 10 tags: / 4
        ("<answer>x</answer>" * 9 + "<answer>Paris</answer>", ["Paris"], {}, 1.0),  # 10 tags: fine
    ],
)
def test_search_r1_is_verls(solution, targets, kwargs, expected):
    assert score(search_r1_score, solution, {"target": targets}, **kwargs) == expected


def test_search_r1_sources():
    sources = [s for s, fn in DATA_SOURCES.items() if fn is search_r1_score]
    assert sources == [
        "searchR1_nq",
        "searchR1_triviaqa",
        "searchR1_popqa",
        "searchR1_hotpotqa",
        "searchR1_2wikimultihopqa",
        "searchR1_musique",
        "searchR1_bamboogle",
    ]
    truth = {"target": ["Paris"]}
    assert default_compute_score("searchR1_hotpotqa", "<answer>paris</answer>", truth) == 1.0
    assert score(search_r1_score, "<answer>Paris</answer>", ["Paris"]) == 1.0  # Trellis: bare targets


def test_verl_sources_trellis_does_not_score_raise():
    with pytest.raises(UnknownDataSourceError, match=r"numina_olympiads.*aime\*"):
        default_compute_score("numina_olympiads", r"\boxed{1}", "1")  # verl: prime_math


def test_verl_rules_match_mathruler_where_it_is_installed():
    grader = pytest.importorskip("mathruler.grader")  # not a dependency; verl's geo3k imports it
    answers = ["3", "3.0", r"\frac{40}{3}", "40/3", r"2\sqrt{3}", r"\sqrt{12}", r"60^\circ", "(1,2)"]
    answers += [r"\left(1,2\right)", r"\frac{\sqrt{3}}{2}", r"4\pi", r"\pi r^2", "12 cm", r"\text{A}"]
    for given in answers:
        for truth in answers:
            assert verl_rules.grade_answer(given, truth) == grader.grade_answer(given, truth)

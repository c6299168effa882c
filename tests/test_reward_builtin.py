"""trellis.reward.builtin: the built-in scoring functions and the data_source dispatcher."""

from __future__ import annotations

import pytest

from trellis.reward.builtin import (
    DATA_SOURCES,
    UnknownDataSourceError,
    arithmetic_score,
    default_compute_score,
    exact_match_score,
    extract_gsm8k_answer,
    format_score,
    gsm8k_score,
    is_math_equiv,
    last_boxed,
    math_score,
    normalize_math_answer,
    normalize_number,
    parse_final_integer,
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


def test_gsm8k_strict_reads_only_the_hash_answer():
    assert score(gsm8k_score, "12 + 7 = 19. #### 19", "19") == 1.0
    assert score(gsm8k_score, "#### $1,000.0", "1000") == 1.0
    assert score(gsm8k_score, "#### 18\nno wait #### 19", "19") == 1.0  # the last one counts
    assert score(gsm8k_score, "The answer is 19", "19") == 0.0  # no ####
    assert score(gsm8k_score, "#### 20", "19") == 0.0
    assert score(gsm8k_score, "#### 20", "19", format_score=0.1) == 0.1
    assert score(gsm8k_score, "no answer at all", "19", format_score=0.1) == 0.0


def test_gsm8k_flexible_takes_the_last_number():
    assert score(gsm8k_score, "The answer is 19", "19", method="flexible") == 1.0
    assert score(gsm8k_score, "The answer is 19", "19", {"method": "flexible"}) == 1.0
    assert score(gsm8k_score, "it costs $2,500.00 in total", "2500", method="flexible") == 1.0
    assert score(gsm8k_score, "19 or maybe 20", "19", method="flexible") == 0.0
    assert extract_gsm8k_answer("a -4 b", "flexible") == "-4"
    with pytest.raises(ValueError, match=r"gsm8k method must be 'strict' or 'flexible', got 'loose'"):
        score(gsm8k_score, "#### 1", "1", method="loose")


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
def test_math_equivalences(answer, truth):
    assert is_math_equiv(answer, truth)
    assert score(math_score, f"so the answer is $\\boxed{{{answer}}}$.", truth) == 1.0


def test_math_differences_and_missing_box():
    assert not is_math_equiv("0.51", r"\frac{1}{2}")
    assert not is_math_equiv(r"\frac{1}{0}", "0")
    assert score(math_score, r"\boxed{3}", "4") == 0.0
    assert score(math_score, "the answer is 3", "3") == 0.0
    assert score(math_score, r"\boxed{2}", r"so \boxed{2}") == 1.0  # a boxed ground truth
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

"""trellis-math-verify: the math_verify reward function, called directly and through the registry."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("math_verify")

from trellis_math_verify.reward import math_verify_score

from trellis import registries


def score(solution, truth, **kwargs):
    return math_verify_score(data_source="math", solution_str=solution, ground_truth=truth, **kwargs)


@pytest.mark.parametrize(
    ("solution", "truth"),
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5"),
        (r"$\boxed{2x + x^2}$", "x^2+2x"),
        (r"We get $\boxed{\frac{\sqrt{2}}{2}}$.", r"\frac{1}{\sqrt{2}}"),
        (r"The answer is $\boxed{12}$", "12"),
        (r"\boxed{3}", r"$\boxed{3}$"),
    ],
)
def test_equivalent_answers_score_one(solution, truth):
    assert score(solution, truth) == 1.0


@pytest.mark.parametrize(
    ("solution", "truth"),
    [(r"$\boxed{\frac{1}{3}}$", "0.5"), (r"$\boxed{x^2}$", "x^3"), ("I cannot tell", "7")],
)
def test_different_or_missing_answers_score_zero(solution, truth):
    assert score(solution, truth) == 0.0


def test_registered_by_entry_point():
    entry = [e for e in registries.reward_functions.entries() if e.name == "math_verify"]
    assert [(e.provider, e.target) for e in entry] == [
        ("trellis-math-verify", "trellis_math_verify.reward:math_verify_score")
    ]
    fn = registries.reward_functions.get("math_verify")
    assert fn is math_verify_score
    from trellis.reward import resolve_reward_function

    bound = resolve_reward_function("math_verify", float_rounding=3)
    assert bound(data_source="m", solution_str=r"$\boxed{0.3333}$", ground_truth=r"\frac{1}{3}") == 1.0


def test_missing_package_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'math-verify>=0.7'"):
        score(r"\boxed{1}", "1")

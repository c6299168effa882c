"""trellis.recipes.arithmetic: the demo's generated word problems, and the built-in reward scoring them."""

from __future__ import annotations

import json
import random
import re

import pytest

from trellis.recipes.arithmetic import DATA_SOURCE, INSTRUCTION, all_keys, make_problem, make_problems
from trellis.reward.builtin import default_compute_score


def test_problems_are_deterministic_and_seeded():
    assert make_problems(64, 32, seed=3) == make_problems(64, 32, seed=3)
    assert make_problems(64, 32, seed=3) != make_problems(64, 32, seed=4)
    train, heldout = make_problems()
    assert (len(train), len(heldout)) == (1024, 200)


def test_heldout_sums_are_distinct_and_never_trained_on():
    train, heldout = make_problems(2000, 300, seed=1)
    held = [p.key for p in heldout]
    assert len(set(held)) == 300
    assert not set(held) & {p.key for p in train}
    assert not {p.question for p in heldout} & {p.question for p in train}
    assert {p.kind for p in train} == {p.kind for p in heldout} == {"add", "sub", "mul"}
    with pytest.raises(ValueError, match="n_heldout must be between 0 and 449"):
        make_problems(10, 450)


def test_answers_are_right_and_questions_state_the_operands():
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
    train, heldout = make_problems(300, 100, seed=2)
    for p in train + heldout:
        assert p.answer == ops[p.kind](p.a, p.b) >= 0
        assert [int(n) for n in re.findall(r"\d+", p.question)] == [p.a, p.b]
        assert p.question.endswith(INSTRUCTION)
    assert len(all_keys()) == len(set(all_keys())) == 400 + 435 + 64
    with pytest.raises(ValueError, match="Unknown kind of problem 'div'"):
        make_problem("div", 6, 3, random.Random(0))


def test_rows_have_what_the_reward_manager_reads():
    problem = make_problem("add", 7, 5, random.Random(0))
    row = problem.row()
    assert row["prompt"] == [{"role": "user", "content": problem.question}]
    assert row["data_source"] == DATA_SOURCE == "arithmetic"
    assert row["reward_model"] == {"ground_truth": "12"}
    json.dumps(row)  # written as JSON lines


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("12", 1.0),
        ("7 + 5 = 12.", 1.0),
        ("Mia has 7 + 5 = 12 marbles.", 1.0),
        ("13", 0.0),
        ("Mia has 7 marbles and gets 5 more, so Mia has 7 +", 0.0),  # cut off before the answer
        ("twelve", 0.0),
        ("", 0.0),
    ],
)
def test_reward_scores_the_final_integer(response, score):
    result = default_compute_score(DATA_SOURCE, response, "12")
    assert result["score"] == score

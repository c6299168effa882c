"""trellis.tools.gsm8k: answer checking, step rewards and the trajectory reward."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from trellis import registries
from trellis.tools.gsm8k import Gsm8kTool, parse_answer


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("72", 72),
        ("The answer is #### 1,234", 1234),
        ("$18.50", Fraction(37, 2)),
        ("first 3 then 5", 5),
        ("-4", -4),
        ("no number", None),
        (None, None),
        (10, 10),
    ],
)
def test_parse_answer(text, value):
    assert parse_answer(text) == value


def test_step_rewards_and_trajectory_reward():
    assert registries.tools.get("gsm8k") is Gsm8kTool
    tool = Gsm8kTool({})

    async def main():
        iid, _ = await tool.create(ground_truth="#### 72")
        steps = [await tool.execute(iid, {"answer": a}) for a in ["70", "71", "the answer is 72", "72.0"]]
        other, _ = await tool.create("other", ground_truth="5")
        wrong_only = [await tool.execute(other, {"answer": "4"}), await tool.execute(other, {"answer": "4"})]
        rewards = (await tool.calc_reward(iid), await tool.calc_reward(other))
        await tool.release(iid)
        await tool.release(other)
        return steps, wrong_only, rewards

    steps, wrong_only, rewards = asyncio.run(main())
    assert [s[1] for s in steps] == [0.0, -0.05, 1.0, 0.0]
    assert steps[0][0].text == "Parsed answer: 70. Incorrect."
    assert steps[2][0].text == "Parsed answer: 72. Correct."
    assert [s[2]["gsm8k/correct"] for s in steps] == [0, 0, 1, 1]
    assert [s[1] for s in wrong_only] == [0.0, -0.05]
    assert rewards == (1.0, 0.0)
    assert tool._instances == {}


def test_create_needs_a_numeric_ground_truth_and_execute_a_known_instance():
    tool = Gsm8kTool({})
    with pytest.raises(ValueError, match=r"ground_truth must contain a number, got 'abc'"):
        asyncio.run(tool.create(ground_truth="abc"))
    with pytest.raises(KeyError, match=r"unknown instance 'nope'; call create\(\) first"):
        asyncio.run(tool.execute("nope", {"answer": "1"}))

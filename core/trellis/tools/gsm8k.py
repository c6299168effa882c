"""``gsm8k``: the model submits ``{"answer": "..."}``; the tool checks it against the ground truth.

Step rewards: ``correct_reward`` (1.0) the first time the answer is right, 0.0 for later correct
answers and for the first wrong one, ``repeat_penalty`` (-0.05) for each wrong answer after a previous
wrong one. ``calc_reward`` is 1.0 if the instance was ever answered correctly, else 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, ClassVar

from trellis.tools.base import BaseTool
from trellis.tools.schema import ToolResponse

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_answer(text: Any) -> Fraction | None:
    """The last number in ``text`` (``"#### 1,234"``, ``"$72.00"``), exactly; None when there is none."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        return None
    text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except ValueError:
        return None


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


class Gsm8kTool(BaseTool):
    """Checks a final answer against ``create(ground_truth=...)``."""

    default_schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "Submit your final numeric answer to the math problem to check it.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "the final answer, e.g. 72"}},
                "required": ["answer"],
            },
        },
    }

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        truth = parse_answer(ground_truth)
        if truth is None:
            raise ValueError(f"gsm8k: ground_truth must contain a number, got {ground_truth!r}")
        return await super().create(
            instance_id, ground_truth=truth, correct=False, wrong_attempts=0, attempts=0
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self.state(instance_id)
        state["attempts"] += 1
        answer = parse_answer(parameters.get("answer"))
        right = answer is not None and answer == state["ground_truth"]
        if right:
            reward = 0.0 if state["correct"] else float(self.config.get("correct_reward", 1.0))
            state["correct"] = True
        else:
            reward = float(self.config.get("repeat_penalty", -0.05)) if state["wrong_attempts"] else 0.0
            state["wrong_attempts"] += 1
        shown = "no number found" if answer is None else _show(answer)
        text = f"Parsed answer: {shown}. {'Correct.' if right else 'Incorrect.'}"
        return ToolResponse(text=text), reward, {"gsm8k/correct": int(right)}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 1.0 if self.state(instance_id)["correct"] else 0.0

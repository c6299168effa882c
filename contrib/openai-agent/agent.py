"""An agent written for the OpenAI API, with nothing of Trellis in it: it asks the model, runs the
Python function the model calls (a calculator), sends back the result, and scores the final answer.

Trellis trains it unchanged (``rollout.agent.function=contrib/openai-agent/agent.py:run``): the
``base_url`` it gets is a gateway session that records every token the policy generates.
"""

from __future__ import annotations

import json
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "calc",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": [],
            },
        },
    }
]


def calculator(expression: str) -> str:
    """The tool: evaluate an arithmetic expression (no names, no builtins)."""
    return str(eval(expression, {"__builtins__": {}}))


def digits(text: str) -> float:
    """The reward: the fraction of the answer's non-space characters that are digits."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


async def run(base_url: str, sample: dict[str, Any]) -> dict[str, float]:
    """One episode: up to two model turns, the calculator between them; the reward and a metric."""
    messages, calls = list(sample["messages"]), 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=40 if turn == 0 else 16
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                calls += 1
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as exc:  # the model's arguments are its own problem: tell it
                    result = f"Error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = messages[-1]
    reward = digits(final.get("content") or "") if final["role"] == "assistant" else 0.0
    return {"reward": reward, "tool_calls": float(calls)}

"""The tiny model as a tool-calling agent: taught, in a few seconds of supervised steps, to answer
"What is 2 + 2?" (with the calculator offered) by calling the calculator; optionally also to answer
with the tool's result. The agent examples and tests start from it: RL then shapes what it says
after the tool answers.

    tok, model, tools = train_calculator_model(answer=False)
    overrides = prepare_agent_run(workdir)      # model folder + data + config for the openai_agent loop
"""

from __future__ import annotations

import json
import os
from typing import Any

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
ANSWER = "The answer is 4"
TOOLS = [
    {
        "name": "calculator",
        "schema": {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "calc",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        },
    }
]
"""The tool config (``rollout.agent.tool_config_path`` format) of the calculator the model calls."""


def train_calculator_model(answer: bool = True, steps: int = 300) -> tuple[Any, Any, dict[str, Any]]:
    """``(tokenizer, model in eval mode, tools)``: ``steps`` Adam steps on the one exchange (without
    ``answer``, on the tool call only, so what follows the tool's result stays untrained).

    Raises:
        RuntimeError: the loss did not fall below 0.01 (the model would not call the tool reliably).
    """
    import torch

    from trellis.recipes.tiny import build_tiny_model, build_tiny_tokenizer
    from trellis.rollout.chat import ChatTemplate
    from trellis.tools.base import load_tools

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    tools = load_tools(TOOLS)
    chat = ChatTemplate(tok)
    prompt = chat.prompt_ids(QUESTION, list(tools.values()))
    turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    between = chat.continuation_ids([{"role": "tool", "content": "4"}])
    turn2 = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq = torch.tensor([prompt + turn1 + between + turn2])
    labels = seq.clone()
    labels[0, : len(prompt)] = -100
    labels[0, len(prompt) + len(turn1) : len(prompt) + len(turn1) + len(between)] = -100
    if not answer:
        labels[0, len(prompt) + len(turn1) :] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=seq, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    if loss.item() >= 0.01:
        raise RuntimeError(f"fine-tuning did not converge (loss {loss.item():.4f}); give more steps.")
    return tok, model.eval(), tools


def prepare_agent_run(workdir: str, rows: int = 64) -> list[str]:
    """Write the tool-calling tiny model (``workdir/model``) and ``rows`` training prompts, and return
    the overrides of a GRPO run of the ``openai_agent`` loop on them (the tiny preset's settings; add
    ``rollout.agent.function=...``)."""
    from trellis.recipes.presets import preset_overrides

    tok, model, _ = train_calculator_model(answer=False)
    folder = os.path.join(workdir, "model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    data = os.path.join(workdir, "train.jsonl")
    row = {"prompt": QUESTION, "data_source": "calculator", "reward_model": {"ground_truth": "4"}}
    with open(data, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for _ in range(rows)))
    return [
        *preset_overrides("tiny"),
        f"model.path={folder}",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        "data.return_raw_chat=true",  # the agent gets the chat messages
        "data.max_prompt_length=256",
        "data.max_response_length=96",  # the tool call (33 tokens), the tool's turn (34), the answer
        "rollout.agent.default_agent_loop=openai_agent",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
    ]

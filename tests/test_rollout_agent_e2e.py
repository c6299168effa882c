"""End to end on a real tiny model: dataset -> agent loops (single_turn, tool_agent with the calculator)
over two hf replicas -> reward manager; the DataProto checked against a forward pass of the model.

The tiny model is first fine-tuned for a few hundred steps (a few seconds) to answer "What is 2 + 2?"
by calling the calculator and then stating the result, so the tool path is taken by the model itself.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from _calculator import CALL, QUESTION

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.data.dataset import RLDataset
from trellis.reward.managers import NaiveRewardManager
from trellis.rollout.agent_loop import AgentLoopManager
from trellis.rollout.chat import ChatTemplate
from trellis.rollout.hf import HFRolloutReplica


def write_data(path, agent_names):
    with open(path, "w") as f:
        for i, agent in enumerate(agent_names):
            row = {
                "prompt": QUESTION,
                "data_source": "arithmetic",
                "reward_model": {"ground_truth": "4"},
                "agent_name": agent,
                "extra_info": {"i": i},
            }
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture
def trained(calculator_model):
    return calculator_model


def rollout(tok, model, tools, data, **cfg):
    config = RolloutConfig(max_tokens=96, calculate_log_probs=True, seed=0, **cfg)

    async def main():
        replicas = [HFRolloutReplica(r, config, ModelConfig()) for r in range(2)]
        for replica in replicas:
            await replica.init("hybrid", model=model, tokenizer=tok)
        try:
            manager = AgentLoopManager(config, replicas, tok, tools=tools)
            return await manager.generate_sequences_async(data), replicas
        finally:
            for replica in replicas:
                await replica.shutdown()

    return asyncio.run(main())


def forward_logprobs(model, out, temperature):
    b = out.batch
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    width = b["responses"].shape[1]
    logits = logits[:, -width - 1 : -1].float() / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None])[..., 0]


def test_single_turn_and_tool_agent_on_the_tiny_model(trained, tmp_path):
    tok, model, tools = trained
    path = write_data(tmp_path / "data.jsonl", ["tool_agent", "single_turn", "tool_agent", "single_turn"])
    dataset = RLDataset(path, tok, max_prompt_length=512, return_raw_chat=True)
    data = dataset.collate_fn([dataset[i] for i in range(len(dataset))])
    out, replicas = rollout(tok, model, tools, data, do_sample=False)

    b, columns = out.batch, out.non_tensor_batch
    size, width = b["responses"].shape
    prompt_width = b["prompts"].shape[1]
    assert size == 4 and b["input_ids"].shape == (4, prompt_width + width)
    for key in ("attention_mask", "position_ids"):
        assert b[key].shape == (4, prompt_width + width)
    assert b["response_mask"].shape == b["rollout_log_probs"].shape == (4, width)
    assert columns["__num_turns__"].tolist() == [4, 2, 4, 2]
    assert columns["data_source"].tolist() == ["arithmetic"] * 4  # dataset columns carried through
    assert sum(r.generate_calls for r in replicas) >= 2 and all(r.generate_calls for r in replicas)

    chat = ChatTemplate(tok)
    between = chat.continuation_ids([{"role": "tool", "content": "4"}])
    call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for i in (0, 2):  # the tool rows: call, tool turn (mask 0), answer
        valid = int(b["attention_mask"][i, prompt_width:].sum())
        text = tok.decode(b["responses"][i, :valid])
        assert text == CALL + "<|im_end|>" + tok.decode(between) + "The answer is 4<|im_end|>"
        mask = b["response_mask"][i, :valid].tolist()
        n = len(call_ids)
        assert mask == [1] * n + [0] * len(between) + [1] * (valid - n - len(between))
        assert b["responses"][i, n : n + len(between)].tolist() == between
        assert '"name": "calculator"' in tok.decode(b["prompts"][i])  # the tool schema is in the prompt
    for i in (1, 3):  # single turn: the dataset's prompt (no tool schemas), every token the model's
        valid = int(b["attention_mask"][i, prompt_width:].sum())
        assert b["response_mask"][i, :valid].eq(1).all() and b["response_mask"][i, valid:].eq(0).all()
        assert "calculator" not in tok.decode(b["prompts"][i])
    assert out.meta_info["metrics"]["tool/calls"] == 0.5  # one call in each of two of four samples

    # the replica's log-probs are those of a teacher-forced pass over the assembled sequences
    expected = forward_logprobs(model, out, 0.0)
    mask = b["response_mask"].bool()
    assert torch.allclose(b["rollout_log_probs"][mask], expected[mask], atol=1e-4)
    assert b["rollout_log_probs"][~mask].eq(0).all()

    # rewards: on the last model token of each response; the tool rows answer correctly
    reward = NaiveRewardManager(tok, compute_score="arithmetic")(out, return_dict=True)
    scores = reward["reward_tensor"]
    assert scores.shape == (4, width)
    for i in range(4):
        last = int(mask[i].nonzero()[-1])
        assert scores[i].nonzero().flatten().tolist() in ([last], [])
    assert scores[0].sum() == 1.0 and scores[2].sum() == 1.0
    assert reward["reward_extra_info"]["parsed"][0] == 4


def test_sampled_logprobs_follow_the_temperature(trained, tmp_path):
    tok, model, tools = trained
    path = write_data(tmp_path / "data.jsonl", ["tool_agent", "single_turn"] * 2)
    dataset = RLDataset(path, tok, max_prompt_length=512, return_raw_chat=True)
    data = dataset.collate_fn([dataset[i] for i in range(len(dataset))])
    out, _ = rollout(tok, model, tools, data, temperature=0.7)
    mask = out.batch["response_mask"].bool()
    expected = forward_logprobs(model, out, 0.7)
    assert mask.sum() > 8
    assert torch.allclose(out.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4)
    again, _ = rollout(tok, model, tools, data, temperature=0.7)  # rollout.seed: the same draws
    assert torch.equal(again.batch["responses"], out.batch["responses"])

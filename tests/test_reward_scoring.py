"""trellis.reward.scoring: the score stage (manager scores + weighted tool rewards, summable counts)."""

from __future__ import annotations

import torch

from trellis.data.protocol import DataProto
from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.reward.managers import NaiveRewardManager
from trellis.reward.scoring import score_batch, sum_counts


def setup_module():
    torch.set_num_threads(1)


def _score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise RuntimeError("bad scorer")
    return {"score": float(solution_str == ground_truth), "length": float(len(solution_str))}


def _batch(tokenizer, texts, truths, tool_rewards=None, width=6):
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        responses[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    tensors = {"responses": responses, "response_mask": mask}
    if tool_rewards is not None:
        tensors["tool_rewards"] = torch.tensor(tool_rewards, dtype=torch.float32)
    columns = {"reward_model": [{"ground_truth": g} for g in truths], "data_source": ["t"] * len(texts)}
    return DataProto.from_dict(tensors, columns), [len(seq) - 1 for seq in ids]


def test_tool_rewards_are_weighted_onto_the_last_model_token():
    tokenizer = build_tiny_tokenizer()
    data, last = _batch(tokenizer, ["a", "b", "c"], ["a", "x", "c"], tool_rewards=[0.5, 2.0, 0.0])
    manager = NaiveRewardManager(tokenizer, compute_score=_score)
    for weight, expected in ((1.0, [1.5, 2.0, 1.0]), (0.25, [1.125, 0.5, 1.0]), (0.0, [1.0, 0.0, 1.0])):
        out = score_batch(manager, data, tool_reward_weight=weight)
        scores = out.batch["token_level_scores"]
        assert [float(scores[i, last[i]]) for i in range(3)] == expected
        assert float(scores.sum()) == sum(expected)  # nothing anywhere else
        assert out.meta_info["metrics"]["reward/tool_sum"] == weight * 2.5
    assert out.non_tensor_batch["reward_extra/length"].tolist() == [1.0, 1.0, 1.0]


def test_agent_loop_rewards_skip_the_manager():
    tokenizer = build_tiny_tokenizer()
    data, last = _batch(tokenizer, ["a", "b"], ["a", "b"], tool_rewards=[1.0, 0.0])
    data.batch["rm_scores"] = torch.zeros(2, 6)
    data.batch["rm_scores"][0, last[0]] = 3.0

    def never(**_):
        raise AssertionError("the manager must not score samples the agent loop scored")

    out = score_batch(never, data, tool_reward_weight=1.0)
    assert (
        out.batch["token_level_scores"][0, last[0]] == 4.0 and out.batch["token_level_scores"][1].sum() == 0
    )


def test_counts_of_several_workers_add_up_to_the_whole_batch():
    tokenizer = build_tiny_tokenizer()
    data, _ = _batch(tokenizer, ["a", "boom", "boom", "c"], ["a", "x", "y", "c"], tool_rewards=[1, 1, 1, 1])
    manager = NaiveRewardManager(tokenizer, compute_score=_score)
    whole = score_batch(manager, data).meta_info["metrics"]
    parts = [score_batch(manager, data[[0, 1]]), score_batch(manager, data[[2, 3]])]
    merged = DataProto.concat(parts).meta_info["metrics"]  # one list per key, as workers' results
    assert sum_counts(merged) == whole
    assert whole == {
        "reward/errors": 2.0,
        "reward/timeouts": 0.0,
        "reward/tool_sum": 4.0,
        "reward/scored": 4.0,
    }

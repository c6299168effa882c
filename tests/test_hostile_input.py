"""Hostile input where a user's data enters: each case gets a clear error naming the row, column, key or
component, or is counted and scored 0 where the run should go on (docs/hostile-input.md lists them all).
The cases pinned elsewhere are named in that table; these are the ones this file pins."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trellis.errors import DatasetError


@pytest.fixture(scope="module")
def tokenizer():
    from trellis.recipes.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_a_corrupt_parquet_file_is_named(tmp_path, tokenizer):
    from trellis.data.dataset import RLDataset

    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"broken.parquet' is not a readable parquet file: .*magic bytes"):
        RLDataset(str(tmp_path / "broken.parquet"), tokenizer)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("   ", "the prompt is empty"),
        (
            [{"role": "system", "content": ""}, {"role": "user", "content": "  "}],
            "every message of the prompt is empty",
        ),
    ],
)
def test_an_empty_prompt_is_refused_naming_its_row(tmp_path, tokenizer, prompt, message):
    from trellis.data.dataset import RLDataset

    rows = [{"prompt": "fine"}, {"prompt": prompt}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=rf"d.jsonl: row 1, column 'prompt': {message}"):
        RLDataset(str(tmp_path / "d.jsonl"), tokenizer)


def _nan_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"nan": float("nan"), "inf": float("inf"), "-inf": -math.inf}.get(solution_str.strip(), 1.0)


def _hog(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str.strip() == "hog":
        hoard = bytearray(2 * 2**30)  # 2 GiB: past the limit
        return float(len(hoard))
    return 1.0


def _data(tokenizer, responses):
    from trellis.data.protocol import DataProto

    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] or [0] for r in responses]
    width = max(len(i) for i in ids)
    tensor = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, i in enumerate(ids):
        tensor[row, : len(i)] = torch.tensor(i)
        mask[row, : len(i)] = 1
    return DataProto.from_dict(
        tensors={"responses": tensor, "response_mask": mask},
        non_tensors={
            "data_source": ["x"] * len(ids),
            "reward_model": [{"ground_truth": "1"}] * len(ids),
            "extra_info": [{}] * len(ids),
        },
    )


def test_non_finite_rewards_are_counted_and_scored_zero(tokenizer, caplog):
    from trellis.reward.managers import NaiveRewardManager

    manager = NaiveRewardManager(tokenizer, compute_score=_nan_score)
    with caplog.at_level("WARNING"):
        out = manager(_data(tokenizer, ["nan", "inf", "-inf", "ok"]), return_dict=True)
    scores = out["reward_tensor"].sum(dim=-1)
    assert torch.isfinite(scores).all() and scores.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert out["metrics"]["reward/errors"] == 3.0
    assert "returned nan (not finite); return a finite number" in caplog.text


def test_a_reward_function_that_balloons_is_stopped_by_its_memory_limit(tokenizer):
    from trellis.reward.managers import AsyncRewardManager

    with AsyncRewardManager(tokenizer, compute_score=_hog, memory_limit_mb=512, num_workers=1) as manager:
        out = manager(_data(tokenizer, ["hog", "ok", "ok"]), return_dict=True)
    assert out["reward_tensor"].sum(dim=-1).tolist() == [0.0, 1.0, 1.0]  # the others still scored
    assert out["metrics"]["reward/errors"] == 1.0


def test_reward_memory_limit_mb_reaches_the_async_manager_and_is_refused_elsewhere(tiny_model_path):
    from trellis.config import load_config
    from trellis.config.base import ConfigValueError
    from trellis.trainer.workers import build_reward_manager

    config = load_config(
        None, [f"model.path={tiny_model_path}", "reward.manager=async", "reward.memory_limit_mb=300"]
    )
    manager = build_reward_manager(config, None)
    try:
        assert manager.memory_limit_mb == 300
    finally:
        manager.close()
    naive = load_config(None, [f"model.path={tiny_model_path}", "reward.memory_limit_mb=300"])
    with pytest.raises(
        ConfigValueError, match=r"'reward.memory_limit_mb' needs .*reward.manager=async.*got 300"
    ):
        build_reward_manager(naive, None)

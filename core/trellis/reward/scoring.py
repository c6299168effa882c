"""The score stage: a batch of responses in, ``token_level_scores`` out.

:func:`score_batch` is what the trainer's score stage runs, wherever ``reward.placement`` puts it (the
driver, or each policy worker on its share of the batch). For each sample:

    score_i = reward manager's score (or the agent loop's own reward, ``rm_scores``)
            + w · tool_reward_i                         (w = reward.tool_reward_weight)

placed on the sample's last model token. Metrics are counts (``reward/errors``, ``reward/timeouts``)
and sums (``reward/tool_sum``), so the results of several workers add up; the trainer turns sums into
means over the whole batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trellis.data.protocol import DataProto

COUNT_METRICS = ("reward/errors", "reward/timeouts", "reward/tool_sum", "reward/scored")
"""Metrics of the score stage that are counts or sums: the results of several workers are added."""


def score_batch(manager: Any, batch: DataProto, *, tool_reward_weight: float = 1.0) -> DataProto:
    """Score ``batch`` (responses with their dataset columns) with a reward manager.

    Args:
        manager: a reward manager (``trellis.reward_managers``), called as
            ``manager(batch, return_dict=True)``; not called when the agent loops already gave every
            sample a reward (``rm_scores``).
        batch: the generate stage's output: ``responses``, ``response_mask`` and the dataset columns,
            optionally ``rm_scores`` (bs, T) and ``tool_rewards`` (bs,).
        tool_reward_weight: w, the weight of the tools' rewards in the score.

    Returns:
        A DataProto of the same rows with ``token_level_scores`` (bs, T) float32, one column
        ``reward_extra/<field>`` per numeric extra field a dict reward returned, and
        ``meta_info["metrics"]`` with the counts of :data:`COUNT_METRICS`.
    """
    metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
    columns: dict[str, np.ndarray] = {}
    tensors = batch.tensors  # a DataProtoError naming the missing tensors when there are none
    if "rm_scores" in tensors:
        scores = tensors["rm_scores"].to(torch.float32).clone()
    else:
        out = manager(batch, return_dict=True)
        scores = out["reward_tensor"]
        metrics.update({k: float(v) for k, v in out.get("metrics", {}).items()})
        for key, values in out.get("reward_extra_info", {}).items():
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                columns[f"reward_extra/{key}"] = np.array(values, dtype=np.float64)
    if "tool_rewards" in tensors:
        tool = tensors["tool_rewards"].to(scores.dtype) * float(tool_reward_weight)
        last = _last_model_token(tensors["response_mask"])
        rows = torch.nonzero(last >= 0).flatten()  # an empty response has no token to carry it
        scores[rows, last[rows]] += tool[rows]
        metrics["reward/tool_sum"] = float(tool.sum())
    metrics["reward/scored"] = float(len(batch))
    return DataProto.from_dict(
        tensors={"token_level_scores": scores}, non_tensors=columns, meta_info={"metrics": metrics}
    )


def _last_model_token(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last 1 in ``response_mask`` (bs,), -1 for a row without one."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return torch.where(response_mask.bool(), positions, -1).max(dim=1).values


def sum_counts(metrics: dict[str, Any]) -> dict[str, float]:
    """Score-stage metrics gathered from several workers (a list per key) added up."""
    return {k: float(np.sum(v)) if isinstance(v, list | tuple) else float(v) for k, v in metrics.items()}

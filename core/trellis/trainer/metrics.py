"""The numbers logged every step: rewards, lengths, advantages, timings, throughput, memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trellis.data.protocol import DataProto
from trellis.device.memory import device_memory_usage


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def compute_data_metrics(batch: DataProto, max_response_length: int) -> dict[str, float]:
    """Reward, score, advantage, return, value and length statistics of a trained batch."""
    b = batch.tensors
    mask = b["response_mask"].bool()
    prompt_width = b["prompts"].shape[1]
    response_length = b["attention_mask"][:, prompt_width:].sum(-1).float()
    prompt_length = b["attention_mask"][:, :prompt_width].sum(-1).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("reward", b["token_level_rewards"].sum(-1)))
    metrics.update(_stats("score", b["token_level_scores"].sum(-1)))
    valid = mask.any(-1)
    if "advantages" in b:
        metrics.update(_stats("advantages", b["advantages"][mask]))
    if "returns" in b:
        metrics.update(_stats("returns", b["returns"][mask]))
    if "values" in b:
        metrics.update(_stats("values", b["values"][mask]))
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = float((response_length >= max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["response/aborted_ratio"] = float((~valid).float().mean())
    return metrics


def compute_throughput_metrics(
    batch: DataProto, timings: dict[str, float], world_size: int
) -> dict[str, float]:
    """Tokens per second of the whole step, overall and per worker."""
    tokens = float(batch.tensors["attention_mask"].sum())
    step = timings.get("step", 0.0)
    if step <= 0:
        return {"perf/total_tokens": tokens}
    return {
        "perf/total_tokens": tokens,
        "perf/throughput": tokens / step,
        "perf/throughput_per_worker": tokens / step / max(1, world_size),
    }


def compute_timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    return {f"timing/{name}": float(seconds) for name, seconds in timings.items()}


def peak_memory_metrics() -> dict[str, float]:
    """This process's peak device memory (the selected backend's ``max_memory_allocated``), in GiB."""
    return {"perf/max_memory_allocated_gib": float(device_memory_usage()["max_allocated_gib"])}


def mean_metrics(per_worker: list[dict[str, Any]]) -> dict[str, float]:
    """The mean over workers of each metric (workers report the same keys)."""
    keys = dict.fromkeys(k for m in per_worker for k in m)
    return {k: float(np.mean([float(m[k]) for m in per_worker if k in m])) for k in keys}


def pass_at_k(scores: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """``(pass@1, pass@n)``: the mean success of a response, and of a prompt's best response.

    A response succeeds when its score is > 0; ``groups`` names each response's prompt.
    """
    success = scores > 0
    by_group: dict[Any, list[bool]] = {}
    for ok, group in zip(success.tolist(), groups.tolist(), strict=True):
        by_group.setdefault(group, []).append(ok)
    pass1 = float(np.mean(success)) if len(success) else 0.0
    passn = float(np.mean([any(v) for v in by_group.values()])) if by_group else 0.0
    return pass1, passn

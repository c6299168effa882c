"""Splitting a batch into micro-batches, and the global counts and metrics around them.

Pure functions on tensors; the collectives they need are passed in as ``all_reduce(tensor, op)``
(identity on one process), so the same code serves every engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trellis.engine.packing import split_by_token_budget

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""``all_reduce(tensor, op)`` with op ``"sum"`` or ``"max"``; returns the reduced tensor."""


def fixed_groups(n: int, micro_batch_size: int) -> list[list[int]]:
    """Rows ``0 .. n-1`` in consecutive groups of ``micro_batch_size`` (the last may be smaller)."""
    return [list(range(start, min(start + micro_batch_size, n))) for start in range(0, n, micro_batch_size)]


def micro_batch_groups(
    lengths: torch.Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    all_reduce: AllReduce,
    device: torch.device,
) -> list[list[int]]:
    """Row groups, one per micro-batch; every data-parallel rank gets the same number of groups.

    With ``max_tokens`` (dynamic batching) rows are grouped by :func:`split_by_token_budget`
    into as few micro-batches of at most ``max_tokens`` real tokens as possible; otherwise in
    consecutive groups of ``micro_batch_size`` rows. The count is then agreed across ranks
    (its maximum, through ``all_reduce``): FSDP all-gathers weights in every forward, so a rank
    that ran fewer micro-batches would leave the others waiting. A rank with too few rows for
    the agreed count gets empty groups ``[]`` at the end; the engine runs a zero-weight dummy
    micro-batch for each.

    Args:
        lengths: ``(n,)`` real tokens per row (the attention mask's row sums).

    Raises:
        ValueError: a row longer than ``max_tokens`` (see :func:`split_by_token_budget`).
    """
    n = int(lengths.shape[0])

    def agreed(count: int) -> int:
        return int(all_reduce(torch.tensor([count], dtype=torch.int64, device=device), "max").item())

    if max_tokens is None:
        groups = fixed_groups(n, micro_batch_size)
        count = agreed(len(groups))
    else:
        count = agreed(len(split_by_token_budget(lengths, max_tokens)) if n else 0)
        while True:  # a larger minimum may need yet more groups on some rank: agree again
            groups = split_by_token_budget(lengths, max_tokens, min_micro_batches=max(1, min(count, n)))
            if not n:
                groups = []
            new_count = agreed(len(groups))
            if new_count == count:
                break
            count = new_count
    return groups + [[] for _ in range(count - len(groups))]


def global_batch_info(response_mask: torch.Tensor, *, dp_size: int, all_reduce: AllReduce) -> dict[str, int]:
    """The counts ``agg_loss`` normalises by, over the whole global batch (all ranks).

    Returns:
        ``{"dp_size", "batch_num_tokens", "global_batch_size"}``: the data-parallel size, the
        masked-in response tokens, and the rows with at least one masked-in token, both summed
        over every rank's ``response_mask`` ``(bs, T)``.
    """
    mask = response_mask.to(torch.int64)
    local = torch.stack([mask.sum(), (mask.sum(dim=-1) > 0).sum()])
    tokens, sequences = all_reduce(local, "sum").tolist()
    return {"dp_size": dp_size, "batch_num_tokens": int(tokens), "global_batch_size": int(sequences)}


class MetricAccumulator:
    """Per-micro-batch metrics, averaged over micro-batches and ranks, weighted by response tokens.

    A metric that is a masked mean over one micro-batch (clip fractions, KL, ...) thus becomes
    the masked mean over the whole global batch. Where no token is masked in (a weight of 0
    everywhere), the plain mean over micro-batches is used. Values may be tensors (0-d or
    1-element; kept on their device, so adding does not synchronise with it) or numbers.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}  # per key: [Σ w·v, Σ w, Σ v, count]

    def add(self, metrics: Mapping[str, Any], weight: torch.Tensor | float) -> None:
        weight = torch.as_tensor(weight, dtype=torch.float64, device=self.device).reshape(())
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(device=self.device, dtype=torch.float64).mean()
            else:
                value = torch.tensor(float(value), dtype=torch.float64, device=self.device)
            row = torch.stack([weight * value, weight, value, torch.ones_like(value)])
            self.sums[key] = self.sums[key] + row if key in self.sums else row

    def reduce(self, keys: list[str], all_reduce: AllReduce) -> dict[str, float]:
        """The averaged metrics; ``keys`` must be the same list on every rank (the union of theirs)."""
        if not keys:
            return {}
        zeros = torch.zeros(4, dtype=torch.float64, device=self.device)
        table = all_reduce(torch.stack([self.sums.get(key, zeros) for key in keys]), "sum").tolist()
        out = {}
        for key, (weighted, weight, plain, count) in zip(keys, table, strict=True):
            out[key] = weighted / weight if weight > 0 else plain / max(count, 1.0)
        return out

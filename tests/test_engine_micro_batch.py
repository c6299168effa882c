"""Micro-batch grouping agreed across ranks, global batch counts and metric averaging."""

from __future__ import annotations

import pytest
import torch

from trellis.engine.micro_batch import MetricAccumulator, fixed_groups, global_batch_info, micro_batch_groups

CPU = torch.device("cpu")


def one_rank(tensor, op):
    return tensor


def with_other_rank(count):
    """An all_reduce as if a second rank contributed ``count`` to every max (and doubled sums)."""

    def all_reduce(tensor, op):
        return torch.maximum(tensor, torch.full_like(tensor, count)) if op == "max" else tensor * 2

    return all_reduce


def test_fixed_groups():
    assert fixed_groups(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_groups(2, 4) == [[0, 1]]


def test_fixed_micro_batches_are_padded_to_the_ranks_maximum():
    lengths = torch.tensor([5, 5, 5])
    groups = micro_batch_groups(lengths, micro_batch_size=2, max_tokens=None, all_reduce=one_rank, device=CPU)
    assert groups == [[0, 1], [2]]
    groups = micro_batch_groups(
        lengths, micro_batch_size=2, max_tokens=None, all_reduce=with_other_rank(4), device=CPU
    )
    assert groups == [[0, 1], [2], [], []]


def test_dynamic_micro_batches_respect_the_budget_and_the_agreed_count():
    lengths = torch.tensor([9, 3, 7, 4, 6])
    groups = micro_batch_groups(lengths, micro_batch_size=1, max_tokens=10, all_reduce=one_rank, device=CPU)
    assert sorted(row for group in groups for row in group) == [0, 1, 2, 3, 4]
    assert all(sum(int(lengths[row]) for row in group) <= 10 for group in groups)
    assert len(groups) == 3
    # another rank needs 4: this one splits into 4 too (no empty group while it has rows)
    groups = micro_batch_groups(
        lengths, micro_batch_size=1, max_tokens=10, all_reduce=with_other_rank(4), device=CPU
    )
    assert len(groups) == 4 and all(groups)
    # another rank needs 7 > 5 rows: every row alone, then empty groups
    groups = micro_batch_groups(
        lengths, micro_batch_size=1, max_tokens=10, all_reduce=with_other_rank(7), device=CPU
    )
    assert len(groups) == 7 and sum(1 for group in groups if group) == 5 and groups[-2:] == [[], []]
    with pytest.raises(ValueError, match="row 0 has 9 tokens, more than the budget of 8"):
        micro_batch_groups(lengths, micro_batch_size=1, max_tokens=8, all_reduce=one_rank, device=CPU)


def test_global_batch_info_counts_every_rank():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_batch_info(mask, dp_size=1, all_reduce=one_rank) == {
        "dp_size": 1,
        "batch_num_tokens": 3,
        "global_batch_size": 2,
    }
    # two ranks holding the same rows: twice the counts
    assert global_batch_info(mask.float(), dp_size=2, all_reduce=with_other_rank(0)) == {
        "dp_size": 2,
        "batch_num_tokens": 6,
        "global_batch_size": 4,
    }


def test_metrics_are_token_weighted_means():
    acc = MetricAccumulator(CPU)
    acc.add({"kl": torch.tensor(1.0), "n": 2}, weight=torch.tensor(3.0))
    acc.add({"kl": torch.tensor(3.0)}, weight=1.0)
    assert acc.reduce(["kl", "n"], one_rank) == pytest.approx({"kl": (1 * 3 + 3 * 1) / 4, "n": 2.0})
    # keys only other ranks reported come back as 0-weight entries; all-zero weights: plain mean
    empty = MetricAccumulator(CPU)
    empty.add({"kl": 4.0}, weight=0.0)
    empty.add({"kl": 2.0}, weight=0.0)
    assert empty.reduce(["kl"], one_rank) == {"kl": 3.0}
    assert MetricAccumulator(CPU).reduce([], one_rank) == {}

"""trellis.algorithms.aggregation: per-token losses to one scalar, independent of the batch split."""

from __future__ import annotations

import re

import pytest
import torch

from trellis.algorithms.aggregation import LOSS_AGG_MODES, agg_loss

NAN = float("nan")
# Row 2 is fully masked; masked-out entries hold NaN to show they never leak in.
LOSS = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0], [NAN, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 18 / 5),  # (1 + 2 + 4 + 5 + 6) / 5 tokens
        ("seq-mean-token-sum", {}, 9.0),  # (3 + 15) / 2 non-empty sequences
        ("seq-mean-token-mean", {}, 3.25),  # (3/2 + 15/3) / 2
        ("seq-mean-token-sum-norm", {}, 3.0),  # (3/3 + 15/3) / 2, S = T = 3
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 4}, 2.25),  # (3/4 + 15/4) / 2
        # global counts and dp_size: Σ / N × dp
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 20}, 1.8),  # 18 / 20 × 2
        ("seq-mean-token-sum", {"dp_size": 4, "global_batch_size": 8}, 9.0),  # 18 / 8 × 4
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 5}, 2.6),  # 6.5 / 5 × 2
        ("seq-mean-token-sum-norm", {"dp_size": 2, "global_batch_size": 3}, 4.0),  # 6 / 3 × 2
        ("token-mean", {"batch_num_tokens": torch.tensor(6.0)}, 3.0),  # a tensor count: 18 / 6
    ],
)
def test_each_mode_on_a_hand_case(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected, abs=1e-6)


def test_an_all_masked_batch_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def _batch(seed: int = 0):
    """8 sequences × 5 tokens with ragged masks, two of them fully masked, and a parameter θ."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(8, 5, generator=gen)
    lengths = torch.tensor([5, 0, 3, 1, 4, 0, 2, 5])
    mask = (torch.arange(5) < lengths[:, None]).long()
    theta = torch.randn(5, generator=gen)
    return data, mask, theta


def _loss_mat(data: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return torch.sin(data * theta) + (data * theta) ** 2


def _grad(loss: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_does_not_depend_on_the_micro_batch_and_dp_split(mode):
    data, mask, theta = _batch()
    theta.requires_grad_(True)
    whole = _grad(agg_loss(_loss_mat(data, theta), mask, mode), theta)

    global_counts = {
        "batch_num_tokens": int(mask.sum()),  # 20
        "global_batch_size": int((mask.sum(-1) > 0).sum()),  # 6
    }
    # 2 DP ranks of 4 sequences; rank 0 splits 1 + 3, rank 1 splits 2 + 2 (uneven on purpose).
    ranks = [[slice(0, 1), slice(1, 4)], [slice(4, 6), slice(6, 8)]]
    rank_grads = []
    for micro_batches in ranks:
        grad = torch.zeros_like(theta)
        for rows in micro_batches:  # gradient accumulation: the micro-batch gradients add up
            loss = agg_loss(_loss_mat(data[rows], theta), mask[rows], mode, dp_size=2, **global_counts)
            grad += _grad(loss, theta)
        rank_grads.append(grad)
    all_reduced = torch.stack(rank_grads).mean(dim=0)  # DP all-reduce averages across ranks
    torch.testing.assert_close(all_reduced, whole, atol=1e-6, rtol=1e-6)

    # single rank, four micro-batches (one of them fully masked): dp_size 1 with the global counts
    accumulated = sum(
        _grad(agg_loss(_loss_mat(data[rows], theta), mask[rows], mode, **global_counts), theta)
        for rows in (slice(0, 1), slice(1, 2), slice(2, 6), slice(6, 8))
    )
    torch.testing.assert_close(accumulated, whole, atol=1e-6, rtol=1e-6)


def test_local_counts_with_micro_batches_would_change_the_gradient():
    # Why the global counts matter: normalising each micro-batch by its own count is not the same.
    data, mask, theta = _batch()
    theta.requires_grad_(True)
    whole = _grad(agg_loss(_loss_mat(data, theta), mask, "token-mean"), theta)
    local = sum(
        _grad(agg_loss(_loss_mat(data[rows], theta), mask[rows], "token-mean"), theta) / 2
        for rows in (slice(0, 1), slice(1, 8))
    )
    assert not torch.allclose(local, whole, atol=1e-3)


def test_dp_without_a_global_count_is_an_error():
    with pytest.raises(ValueError, match=r"dp_size=2 but batch_num_tokens is None.*pass batch_num_tokens="):
        agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match=r"global_batch_size is None.*pass global_batch_size="):
            agg_loss(LOSS, MASK, mode, dp_size=2, batch_num_tokens=10)


def test_unknown_mode_and_bad_arguments_are_errors():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unknown loss_agg_mode 'token-sum'. Valid modes: token-mean, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm."
        ),
    ):
        agg_loss(LOSS, MASK, "token-sum")
    with pytest.raises(ValueError, match=r"loss_mat has shape \(3, 3\) but loss_mask has shape \(3, 2\)"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="dp_size=0 must be >= 1"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=0)
    with pytest.raises(ValueError, match="batch_num_tokens=-1 must be a count >= 0"):
        agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=-1)
    with pytest.raises(ValueError, match="loss_scale_factor=0 must be > 0"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)

"""Loss aggregation: how a ``(bs, T)`` matrix of per-token losses becomes the one scalar that is
back-propagated.

Every mode normalises by a count over the *global* batch (all micro-batches of a mini-batch on
all data-parallel ranks), so that the gradient of one optimizer step does not depend on how the
mini-batch was split. The engine runs ``backward`` on each micro-batch and the gradients add up;
it then all-reduces them across the ``dp_size`` data-parallel ranks, and that all-reduce
*averages* (divides by ``dp_size``). Each rank therefore multiplies its loss by ``dp_size``, so that

    mean over ranks of Σ_{micro-batches} agg_loss(...)  ==  agg_loss(whole global batch).

The global counts come from the engine, which hands them to the loss function of each micro-batch as
``global_batch_info`` (:class:`GlobalBatchInfo`); policy and value losses take it as an explicit
argument, ``global_batch_info=``, and pass it on as ``agg_loss(..., **global_batch_info)``:

- ``dp_size``: number of data-parallel ranks whose gradients are averaged.
- ``batch_num_tokens``: masked-in tokens of the whole global mini-batch (all ranks, all micro-batches).
- ``global_batch_size``: sequences of the global mini-batch that have at least one masked-in token.

When the engine gives no counts and ``dp_size == 1``, the local counts of the tensor passed in
are used: exact for a single micro-batch, but with gradient accumulation the result then depends
on the split. With ``dp_size > 1`` the local counts would silently give the wrong gradient, so a
missing count is an error.

Modes (``LOSS_AGG_MODES``), with M the mask, L the loss, N the global token count and B the
global count of non-empty sequences:

- ``token-mean``:               Σ_{i,t} M·L / N                    (every token weighs the same)
- ``seq-mean-token-sum``:       Σ_i (Σ_t M·L) / B                  (long sequences weigh more)
- ``seq-mean-token-mean``:      Σ_i (Σ_t M·L / Σ_t M) / B          (every sequence weighs the same)
- ``seq-mean-token-sum-norm``:  Σ_i (Σ_t M·L / S) / B, S = ``loss_scale_factor`` (default T),
  a constant such as the maximum response length (Dr. GRPO)

Fully masked sequences contribute nothing and are not counted in B.
"""

from __future__ import annotations

from numbers import Real
from typing import TypedDict

import torch

from trellis.algorithms.masked import masked_mean, masked_sum


class GlobalBatchInfo(TypedDict, total=False):
    """Counts over the whole global mini-batch (all micro-batches on all data-parallel ranks)."""

    dp_size: int
    batch_num_tokens: int | torch.Tensor | None
    global_batch_size: int | torch.Tensor | None


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""The values ``loss_agg_mode`` may take."""


def _global_count(
    given: int | float | torch.Tensor | None, local: torch.Tensor, dp_size: int, argument: str
) -> torch.Tensor | int | float:
    """The divisor: the engine's global count if given, else the local one (single rank only)."""
    if given is None:
        if dp_size != 1:
            raise ValueError(
                f"agg_loss: dp_size={dp_size} but {argument} is None. With data parallelism the local "
                f"count would give the wrong gradient; pass {argument}= the count over the whole global "
                "batch (all ranks and micro-batches), e.g. via config['global_batch_info']."
            )
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.clamp(min=1)
    if not isinstance(given, Real) or given < 0:
        raise ValueError(f"agg_loss: {argument}={given!r} must be a count >= 0 (or a tensor holding one).")
    return max(given, 1)  # an all-masked global batch: the loss is 0 either way; avoid 0/0


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token losses into the scalar this rank back-propagates.

    Args:
        loss_mat: ``(bs, T)`` per-token losses.
        loss_mask: ``(bs, T)``, 1 on tokens that count.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (see the module docstring).
        dp_size: data-parallel ranks whose gradients are averaged; the loss is multiplied by it.
        batch_num_tokens: masked-in tokens of the global batch (``token-mean``). None: the local
            count, allowed only with ``dp_size == 1``.
        global_batch_size: non-empty sequences of the global batch (``seq-mean-*``). None: the local
            count, allowed only with ``dp_size == 1``.
        loss_scale_factor: the divisor S of ``seq-mean-token-sum-norm``; None means T.

    Returns:
        A 0-d tensor.

    Raises:
        ValueError: unknown mode; shapes differ; ``dp_size > 1`` without the global count the mode
            needs; a negative count; ``loss_scale_factor <= 0``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown loss_agg_mode {loss_agg_mode!r}. Valid modes: {', '.join(LOSS_AGG_MODES)}."
        )
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat has shape {tuple(loss_mat.shape)} but loss_mask has shape "
            f"{tuple(loss_mask.shape)}; pass a mask of the same (bs, T) shape."
        )
    if dp_size < 1:
        raise ValueError(f"agg_loss: dp_size={dp_size!r} must be >= 1 (the number of data-parallel ranks).")

    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        n_tokens = _global_count(batch_num_tokens, mask.sum(), dp_size, "batch_num_tokens")
        return masked_sum(loss_mat, mask) / n_tokens * dp_size  # Σ M·L / N × dp

    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = masked_sum(loss_mat, mask, axis=-1)  # Σ_t M·L
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, mask, axis=-1)  # Σ_t M·L / Σ_t M; 0 for an empty row
    else:  # seq-mean-token-sum-norm
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if scale <= 0:
            raise ValueError(
                f"agg_loss: loss_scale_factor={loss_scale_factor!r} must be > 0 (e.g. the maximum "
                "response length), or None for T."
            )
        seq_losses = masked_sum(loss_mat, mask, axis=-1) / scale  # Σ_t M·L / S
    non_empty = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    n_seqs = _global_count(global_batch_size, non_empty.sum(), dp_size, "global_batch_size")
    return seq_losses.sum() / n_seqs * dp_size  # Σ_i seq_loss_i / B × dp (empty rows hold 0)

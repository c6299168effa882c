"""Statistics over the masked-in entries of a tensor.

``mask`` is 1 (or True) on entries that count and 0 elsewhere, broadcastable to ``values``.
Entries outside the mask never influence a result, even when they hold NaN or inf.
"""

from __future__ import annotations

import torch


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # torch.where, not values * mask: 0 * inf is NaN, and padding may hold anything.
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Σ values over the mask (over ``axis``, or everything when None)."""
    masked = _masked(values, mask)
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask; 0 where the mask is empty (instead of NaN)."""
    mask = mask.to(values.dtype).expand_as(values) if mask.shape != values.shape else mask.to(values.dtype)
    total = masked_sum(values, mask, axis)
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked-in entries (all of them together).

    ``unbiased`` applies Bessel's correction n/(n−1); with a single entry the variance is 0.

    Raises:
        ValueError: the mask selects nothing.
    """
    count = mask.to(values.dtype).expand_as(values).sum()
    if count == 0:
        raise ValueError(
            "masked_var: the mask selects no entries; there is nothing to compute a variance of."
        )
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        variance = variance * count / (count - 1) if count > 1 else torch.zeros_like(variance)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values − mean) / sqrt(var + eps) with mean and (unbiased) variance over the mask.

    With ``shift_mean=False`` the mean is added back (scale only). Entries outside the mask
    are transformed too (callers zero them with the mask if they need to).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean

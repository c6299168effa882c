"""Triton kernels of the fused RMSNorm: the CUDA backend of :class:`trellis.engine.fused.RMSNormFunction`.

Imported by :mod:`trellis.engine.fused` only when a CUDA tensor reaches the norm and ``triton`` imports;
importing this module needs triton (it is an optional dependency) and touches no device.

Rows are the last dim of a ``(..., hidden)`` input, flattened to ``(rows, hidden)``; one row fits one
program's block (:func:`supports`: up to 64 KiB of it), so every reduction is a single ``tl.sum``.

- forward: one program per row. It stores the row's reciprocal RMS ``rstd`` (float32) for backward
  and writes ``y = weight · (x·rstd).to(x.dtype)``: float32 arithmetic, rounded where Hugging Face's
  ``LlamaRMSNorm`` rounds.
- backward: a grid of about two programs per SM, each taking a block of consecutive rows. Per row,
  from ``x`` and ``rstd`` alone (with ``g = (grad·weight).to(x.dtype)``, ``n = x·rstd``, ``H`` = hidden)::

      dx = rstd·g − x · rstd³ · Σ_j(g_j·x_j) / H

  and each program adds ``grad · n.to(x.dtype)`` of its rows into its own float32 partial of the
  weight gradient, ``(programs, hidden)``; torch sums the partials afterwards (no atomics, so the
  result does not depend on scheduling).

``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (slowly), which is how to check them without a
GPU; :func:`forward` and :func:`backward` accept CPU tensors for that reason. (The interpreter truncates
float32 → bfloat16 where a GPU rounds to nearest: expect bfloat16 results one ulp off there.)
"""
# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's annotations itself: only the tl.constexpr ones are written, and evaluated
# (no `from __future__ import annotations` here).

import contextlib

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

MAX_ROW_BYTES = 65536
"""The largest block (``next_power_of_2(hidden) × element size``) one program holds; longer rows take the
torch path."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input and weight dtypes the kernels take (float64 takes the torch path)."""


@triton.jit
def _forward_kernel(X, Y, W, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)  # 1 / sqrt(mean(x²) + eps)
    tl.store(RSTD + row, rstd)
    normed = (x32 * rstd).to(x.dtype)  # rounded to the input dtype, as Hugging Face does
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # int64 offsets: rows × stride can pass 2³¹ elements
    DY += row_start.to(tl.int64) * stride_dy
    X += row_start.to(tl.int64) * stride_x
    DX += row_start.to(tl.int64) * stride_dx
    for row in range(row_start, row_end):
        x = tl.load(X + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        dw += dy * (x32 * rstd).to(x.dtype).to(tl.float32)  # grad · n, n rounded as in the forward
        g = (dy * w).to(x.dtype).to(tl.float32)  # the gradient of the rounded n, cast as autograd does
        coef = tl.sum(g * x32, axis=0) * rstd * rstd * rstd / n_cols  # rstd³ Σ_j(g_j·x_j) / H
        dx = g * rstd - x32 * coef
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        X += stride_x
        DY += stride_dy
        DX += stride_dx
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` ``(..., hidden)`` and ``weight``: kernel dtypes, some rows, a row
    that fits one block."""
    hidden = x.shape[-1] if x.dim() else 0
    return (
        x.dtype in DTYPES
        and weight.dtype in DTYPES
        and x.numel() > 0
        and triton.next_power_of_2(hidden) * x.element_size() <= MAX_ROW_BYTES
    )


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``(rows, hidden)`` with unit stride along hidden (copied only where needed)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_settings(hidden: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``hidden`` values: a row per block, more warps for longer rows."""
    block = triton.next_power_of_2(hidden)
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


def _programs(device: torch.device) -> int:
    """The backward grid: about two programs per SM (a few on CPU, under ``TRITON_INTERPRET=1``)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device``'s GPU: Triton launches on the current device, which may be another one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton forward; same contract as :func:`trellis.engine.fused.rms_norm_forward`.

    Returns:
        ``(y, rstd)``: ``y`` shaped like ``x`` in ``promote_types(x.dtype, weight.dtype)``, ``rstd``
        ``(..., 1)`` float32.
    """
    hidden = x.shape[-1]
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    block, num_warps = _launch_settings(hidden)
    with _on(x.device):
        _forward_kernel[(rows.shape[0],)](
            rows, y, weight.contiguous(), rstd, rows.stride(0), y.stride(0), hidden, eps,
            BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)


def backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton backward; same contract as :func:`trellis.engine.fused.rms_norm_backward`.

    Returns:
        ``(grad_x, grad_weight)`` in the dtypes of ``x`` and ``weight``.
    """
    hidden = x.shape[-1]
    rows, grad_rows = _rows(x), _rows(grad)
    n_rows = rows.shape[0]
    grad_x = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    programs = min(n_rows, _programs(x.device))
    rows_per_program = triton.cdiv(n_rows, programs)
    partial = torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
    block, num_warps = _launch_settings(hidden)
    with _on(x.device):
        _backward_kernel[(programs,)](
            grad_rows, rows, weight.contiguous(), rstd.reshape(-1).contiguous(), grad_x, partial,
            grad_rows.stride(0), rows.stride(0), grad_x.stride(0), n_rows, hidden, rows_per_program,
            BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return grad_x.view(x.shape), partial.sum(0).to(weight.dtype)

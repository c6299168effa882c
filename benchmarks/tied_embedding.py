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
from _common import compare_sides, run_script_side, side_parser, train_and_print_timings, training_only

SIDES = ("dense", "sparse")


def main() -> int:
    parser = side_parser(__doc__.split("\n")[0])
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
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

    compare_sides("embedding gradient", list(SIDES), args, lambda side: run_script_side(__file__, side, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

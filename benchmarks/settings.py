"""The demo's step under each of several settings: time and peak memory, side by side in the same run.

    python benchmarks/settings.py "KEY=A [KEY2=B ...]" "KEY=C ..." [...] [--steps 4] [--rounds 2]
                                  [--threads 2] [--preset demo]

Each positional argument is one side: a space-separated list of config overrides (``""`` is the
preset as it is); the first side is the baseline. Without any, the sides are :data:`DEFAULT_SIDES`
(the example below). Every side trains the preset for ``--steps`` steps in a fresh Python process (so
the sides never share the cores and each has its own peak), the sides alternating which goes first
from round to round; no validation and no checkpoints. The first step of
each side is dropped (it faults the process's memory in); the table gives medians over the other
steps of every round of ``timing/update_actor``, ``timing/generate`` and ``timing/step``, each as a
ratio to the baseline, and the largest peak resident set of the side's processes (``VmHWM``).

For example, where the colocated ``hf`` replica decodes (docs/performance.md, "Decoding on the
event loop's thread")::

    python benchmarks/settings.py rollout.engine_kwargs.decode_thread=worker \\
        rollout.engine_kwargs.decode_thread=loop

``benchmarks/micro_batch.py`` is the same comparison over ``actor.ppo_micro_batch_size_per_device``.
This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import sys

# benchmarks/_common.py: the script's own folder
from _common import (
    compare_sides,
    run_fresh_side,
    train_and_print_timings,
    training_only,
)

DEFAULT_SIDES = ["rollout.engine_kwargs.decode_thread=worker", "rollout.engine_kwargs.decode_thread=loop"]
"""Without sides: where the colocated replica decodes, in a worker thread (the base) or on the loop's."""


def run_side(args: argparse.Namespace, side: str) -> dict:
    command = [sys.executable, __file__, "--run", side, "--steps", str(args.steps)]
    command += ["--threads", str(args.threads), "--preset", args.preset]
    return run_fresh_side(command, args.threads, side or "(preset)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sides_help = "one side: 'key=value ...'; the 1st is the base"
    parser.add_argument("sides", nargs="*", metavar="OVERRIDES", help=sides_help, default=DEFAULT_SIDES)
    parser.add_argument("--steps", type=int, default=4, help="steps a side and round (1st dropped)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating the order")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"])
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step of each side is dropped), got {args.steps}")
    if args.run is not None:
        overrides = [*training_only(args.preset, args.steps, "settings"), *args.run.split()]
        train_and_print_timings(overrides, args.threads, args.run or "(preset)")
        return 0
    if len(args.sides) < 2 or len(set(args.sides)) < len(args.sides):
        parser.error(f"give two or more different sides (override lists), got {args.sides}")
    bad = [o for side in args.sides for o in side.split() if "=" not in o]
    if bad:
        parser.error(f"overrides are key=value, got {bad}")

    names = {side: side or "(preset)" for side in args.sides}
    compare_sides("settings", args.sides, args, lambda side: run_side(args, side), names=names)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's update and generation with each attention kernel: ``sdpa`` against ``eager``, same run.

    python benchmarks/attention.py [--steps 4] [--rounds 2] [--threads 2] [--preset demo]
                                   [--attn sdpa eager] [key=value ...]
    python benchmarks/attention.py --attn eager eager+native-decode   # the replica's decode attention

Trains a preset (``demo``: SmolLM2-135M-Instruct, GRPO, a 60-token prompt and 8 responses of at
most 16 tokens a group) for ``--steps`` steps with ``model.attn_implementation`` set to each of
``--attn`` in turn, each side in a fresh Python process started by this script (so they never share
the cores), the sides alternating which goes first from round to round. No validation and no
checkpoints. The first step of each side is dropped (it faults in the process's memory); the figures
are medians over the other steps of every round: ``timing/update_actor`` (forward, backward and
optimizer step over the batch), ``timing/generate`` (the colocated ``hf`` replica, which loads the
model with the same attention) and ``timing/step``, each also as a ratio to the first side of
``--attn`` (the baseline). The preset's dtype applies (bf16 where the CPU computes it natively);
``model.dtype=float32`` as an override compares in float32.

A side named ``KERNEL+native-decode`` trains with ``KERNEL`` but lets the ``hf`` replica's lean decoding
step run its attention in the activations' own dtype (``trellis.rollout.hf_lean.attention_upcast``
patched to None in that side's process), where by default it runs on float32 copies for bf16 / fp16 on
the CPU: ``--attn eager eager+native-decode`` measures what those copies buy ``timing/generate``.

Why it matters on a CPU: at the demo's lengths every attention call is a few small matrices, and
``sdpa``'s CPU flash kernel has a cost per call (blocking, buffers) that such short sequences cannot
hide; ``eager`` (matmul, softmax, matmul) keeps every score in memory, so it is for short sequences
only: at 2048 tokens it holds 4 x heads x 2048^2 bytes a layer for backward. This is a measurement,
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

NATIVE_DECODE = "+native-decode"


def side(args: argparse.Namespace) -> None:
    """One side, in this process: train and print one JSON line of per-step timings."""
    from trellis.rollout import hf_lean

    kernel = args.side.removesuffix(NATIVE_DECODE)
    if kernel != args.side:
        hf_lean.attention_upcast = lambda x: None  # the lean step's attention in the activations' dtype
    overrides = [
        *training_only(args.preset, args.steps, f"attention-{kernel}"),
        f"model.attn_implementation={kernel}",
        *args.overrides,
    ]
    train_and_print_timings(overrides, args.threads, args.side)


def main() -> int:
    parser = side_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--attn", nargs="+", default=["sdpa", "eager"],
        help=f"kernels (KERNEL{NATIVE_DECODE}: decode attention in the model's dtype); the 1st is the base",
    )  # fmt: skip
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step of each side is dropped), got {args.steps}")
    if args.side:
        side(args)
        return 0

    run = lambda attn: run_script_side(__file__, attn, args)  # noqa: E731
    compare_sides("attention", args.attn, args, run, peaks=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

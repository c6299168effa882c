"""Start-up cost of Trellis next to bare Python and torch, measured in the same run.

    python benchmarks/startup.py [--repeats N] [--train-repeats M]

Prints the median wall time of each command over N runs (after one warm-up run each) and its
cost over bare ``python -c pass``. Targets: ``import trellis`` under 0.3 s over bare Python;
``trellis plugins list`` under 1 s; ``trellis train --preset tiny`` (12 GRPO steps on the tiny
model, end to end: imports, model and data, validation, the reward curve, exit) within 4 s,
shown next to ``import trellis; import torch`` and next to the imports of what a training run needs
(torch; tensordict, whose import pulls in ``torch._dynamo``, as transformers' masking code does too;
transformers' tokenizer and the tiny model's class; matplotlib's Agg figure for the reward curve):
no training command can cost less than those with these dependencies. Each train
run writes into a fresh run directory; the warm-up run builds the preset's cached model and data.
The commands inherit the environment: set ``OMP_NUM_THREADS`` as you would for a run (the table
header says what it was). This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

BIN = os.path.dirname(sys.executable)
Command = list[str] | Callable[[int], list[str]]
"""A command line, or one per repeat (given the repeat's index; -1 for the warm-up run)."""
TRAIN = "trellis train --preset tiny"
TORCH_FLOOR = "import trellis; import torch"
DEPS_FLOOR = (
    "import torch, tensordict, matplotlib.figure, matplotlib.backends.backend_agg; "
    "from transformers import AutoTokenizer, LlamaForCausalLM"
)
"""What ``trellis train --preset tiny`` imports from its dependencies (the tiny model is a Llama)."""
DEPS = "dependency imports"


def median_seconds(cmd: Command, repeats: int) -> float:
    def line(i: int) -> list[str]:
        return cmd(i) if callable(cmd) else cmd

    subprocess.run(line(-1), check=True, stdout=subprocess.DEVNULL)  # warm the file cache
    times = []
    for i in range(repeats):
        argv = line(i)
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--train-repeats", type=int, default=5, help="repeats of the tiny training run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trellis-startup-") as runs:
        trellis = os.path.join(BIN, "trellis")

        def train_tiny(i: int) -> list[str]:
            return [
                trellis,
                "train",
                "--preset",
                "tiny",
                f"trainer.run_dir={os.path.join(runs, f'run{i + 1}')}",
            ]

        python, n = sys.executable, args.repeats
        # (label, command, repeats, target): target is (what it is measured against, limit in s)
        cases: list[tuple[str, Command, int, tuple[str, float] | None]] = [
            ("python -c pass", [python, "-c", "pass"], n, None),
            ("python -c 'import torch'", [python, "-c", "import torch"], n, None),
            ("python -c 'import trellis'", [python, "-c", "import trellis"], n, ("over bare", 0.3)),
            ("trellis plugins list", [trellis, "plugins", "list"], n, ("absolute", 1.0)),
            (TORCH_FLOOR, [python, "-c", TORCH_FLOOR], n, None),
            (DEPS, [python, "-c", DEPS_FLOOR], n, None),
            (TRAIN, train_tiny, args.train_repeats, ("absolute", 4.0)),
        ]
        results = {label: median_seconds(cmd, repeats) for label, cmd, repeats, _ in cases}
    bare = results["python -c pass"]
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"Start-up, median of {args.repeats} runs ({args.train_repeats} for training; "
        f"{sys.version.split()[0]}, {os.cpu_count()} cpus, OMP_NUM_THREADS={threads})"
    )
    print(f"{'command':30} {'median s':>9} {'over bare s':>12} {'x bare':>7}  target")
    for label, _, _, target in cases:
        seconds = results[label]
        note = ""
        if target is not None:
            kind, limit = target
            value = seconds - bare if kind == "over bare" else seconds
            note = f"< {limit} s {kind}: {'met' if value < limit else 'MISSED'} ({value:.3f} s)"
        if label == TRAIN:  # how far from the target, and how far from the least it could cost
            floor, deps = results[TORCH_FLOOR], results[DEPS]
            note += (
                f", {seconds / limit:.2f}x the target; {seconds / floor:.1f}x '{TORCH_FLOOR}'; "
                f"{seconds - deps:.2f} s beyond the dependency imports ({deps:.2f} s)"
            )
        print(f"{label:30} {seconds:9.3f} {seconds - bare:12.3f} {seconds / bare:7.2f}  {note}")


if __name__ == "__main__":
    main()

"""Start-up cost of Trellis next to bare Python and torch, measured in the same run.

    python benchmarks/startup.py [--repeats N]

Prints the median wall time of each command over N runs (after one warm-up run each) and its
cost over bare ``python -c pass``. Targets: ``import trellis`` under 0.3 s over bare Python;
``trellis plugins list`` under 1 s. This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

BIN = os.path.dirname(sys.executable)


def median_seconds(cmd: list[str], repeats: int) -> float:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)  # warm the file cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    cases = [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"], None),
        ("python -c 'import trellis'", [sys.executable, "-c", "import trellis"], ("over bare", 0.3)),
        ("trellis plugins list", [os.path.join(BIN, "trellis"), "plugins", "list"], ("absolute", 1.0)),
    ]
    results = {label: median_seconds(cmd, args.repeats) for label, cmd, _ in cases}
    bare = results["python -c pass"]
    print(f"Start-up, median of {args.repeats} runs ({sys.version.split()[0]}, {os.cpu_count()} cpus)")
    print(f"{'command':30} {'median s':>9} {'over bare s':>12} {'x bare':>7}  target")
    for label, _, target in cases:
        seconds = results[label]
        note = ""
        if target is not None:
            kind, limit = target
            value = seconds - bare if kind == "over bare" else seconds
            note = f"< {limit} s {kind}: {'met' if value < limit else 'MISSED'} ({value:.3f} s)"
        print(f"{label:30} {seconds:9.3f} {seconds - bare:12.3f} {seconds / bare:7.2f}  {note}")


if __name__ == "__main__":
    main()

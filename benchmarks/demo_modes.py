"""The demo in each training mode: wall time, held-out accuracy, and the time to reach sync's accuracy.

    python benchmarks/demo_modes.py [--modes sync,async] [--seeds 1] [--steps 40] [--test-freq 8]
                                    [key=value ...]

Each run is ``python -m trellis.recipes.demo`` in a process of its own (as a user runs it: the preset's
settings, the demo's SmolLM2 model and arithmetic task), with ``trainer.seed``, ``trainer.test_freq``
(greedy validations on the 200 held-out problems every that many steps, and before the first), the
mode's overrides and then the ``key=value`` overrides given to this script (the same for every run):

- ``sync``: the preset (colocated: one process generates, then trains, on every core);
- ``async``: ``trainer.mode=async rollout.mode=standalone rollout.max_staleness=1`` with the replica's
  log-probs as the old ones (``rollout.calculate_log_probs=true algorithm.off_policy=behaviour``):
  the replica in a process of its own, the trainer on the cores it leaves, and on its cores while it
  waits (``trainer.share_cores``, on by default);
- ``async_fixed``: the same with ``trainer.share_cores=false`` (a fixed split of the cores).

Printed per seed and mode: the process's wall time, the held-out accuracy before and after, and the
wall time at which a validation first reached the accuracy the sync run of that seed ended with
(from each validation's time in the run's ``metrics.jsonl``, counted from the process's start), then
a summary over the seeds. The target (issue "Asynchronous and off-policy training"): the demo reaches
its accuracy in less wall time with ``trainer.mode=async``. A measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ASYNC = [
    "trainer.mode=async",
    "rollout.mode=standalone",
    "rollout.max_staleness=1",
    "rollout.calculate_log_probs=true",
    "algorithm.off_policy=behaviour",
]
MODES = {"sync": [], "async": ASYNC, "async_fixed": [*ASYNC, "trainer.share_cores=false"]}


def run(
    mode: str, seed: int, steps: int, test_freq: int, root: str, extra: list[str] | None = None
) -> dict[str, Any]:
    """One demo process; its wall time and ``[(seconds since its start, held-out accuracy)]``.
    ``extra``: further overrides, after the mode's and those above."""
    run_dir = os.path.join(root, f"{mode}-{seed}")
    overrides = [
        *MODES[mode],
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        f"trainer.run_dir={run_dir}",
        "trainer.trackers=[jsonl]",
        *(extra or []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRELLIS_NUM_THREADS"}
    start = time.time()
    subprocess.run(
        [sys.executable, "-m", "trellis.recipes.demo", *overrides],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    wall = time.time() - start
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    shutil.rmtree(run_dir, ignore_errors=True)
    points = [(row["time"] - start, row["val/pass@1"]) for row in rows if "val/pass@1" in row]
    steps_s = [row["timing/step"] for row in rows if "timing/step" in row]
    return {"wall": wall, "points": points, "step_s": statistics.median(steps_s)}


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The time of the first validation at or above ``target`` (None: never reached)."""
    return next((t for t, accuracy in points if accuracy >= target - 1e-9), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="sync,async", help=f"sync first, then any of {list(MODES)}")
    parser.add_argument("--seeds", default="1", help="comma-separated trainer.seed values")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--test-freq", type=int, default=8)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or modes[0] != "sync" or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: start with sync (the baseline), then modes of {list(MODES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    root = tempfile.mkdtemp(prefix="trellis-demo-modes-")
    print(
        f"demo: {args.steps} steps, validation every {args.test_freq}; {os.cpu_count()} cpus; "
        f"seeds {', '.join(map(str, seeds))}"
    )
    print(
        f"{'seed':>4}  {'mode':<12}{'wall s':>8}{'step s':>8}{'before':>8}{'after':>8}"
        f"{'to sync acc s':>15}{'vs sync':>9}"
    )
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    try:
        for seed in seeds:
            target = None
            for mode in modes:
                r = run(mode, seed, args.steps, args.test_freq, root, args.overrides)
                target = r["points"][-1][1] if target is None else target  # sync's final accuracy
                r["to_target"] = time_to(r["points"], target)
                base = results["sync"][-1]["to_target"] if mode != "sync" else r["to_target"]
                r["ratio"] = r["to_target"] / base if r["to_target"] and base else None
                results[mode].append(r)
                reached = f"{r['to_target']:.0f}" if r["to_target"] is not None else "never"
                ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
                print(
                    f"{seed:>4}  {mode:<12}{r['wall']:>8.0f}{r['step_s']:>8.2f}{r['points'][0][1]:>8.3f}"
                    f"{r['points'][-1][1]:>8.3f}{reached:>15}{ratio:>9}",
                    flush=True,
                )
        if len(seeds) > 1:
            print("\nmean over the seeds:")
            for mode, rows in results.items():
                ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
                reached = sum(r["to_target"] is not None for r in rows)
                print(
                    f"  {mode:<12} wall {statistics.mean(r['wall'] for r in rows):.0f} s, after "
                    f"{statistics.mean(r['points'][-1][1] for r in rows):.3f}, reached sync's accuracy in "
                    f"{reached}/{len(rows)} runs"
                    + (f", time to it {statistics.mean(ratios):.2f}x sync's" if ratios else "")
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Asynchronous against synchronous training: trained samples per second, idle fractions, held-out reward.

    python benchmarks/async_vs_sync.py [--steps 10] [--no-smollm2] [--models tiny,smollm2] [--seeds 1,2,3]

Each mode trains the same prompts with the same model and seed on the same cores: one process
generates (a standalone ``hf`` replica, a Ray actor with one torch thread) and one trains (the
driver, one torch thread). The modes: ``sync`` (generate, then train), ``one_step_off`` (the next
batch generates while this one trains) and ``async`` with ``rollout.max_staleness=2`` (the replica
generates prompt groups continuously into the replay pool; each step trains as soon as its groups
are ready), and ``async_partial``, the same with ``rollout.partial_rollout=true`` (a weight sync
interrupts the rows in flight after their current token instead of waiting for them to finish; they
resume under the new weights), and ``async_behaviour``, async with ``algorithm.off_policy=behaviour``
(the replica's log-probs as the old ones: the PPO clip around the weights that generated each token).
Response lengths have a long tail: ``max_response_length`` is raised
well above what most answers need, so a few responses per batch run to the limit while most stop
early (the tiny model's eos is rare; SmolLM2 answers the arithmetic task in a few tokens but
sometimes rambles).

Printed per model and mode: trained samples per second over steps 2..N (the first step of the
overlapping modes waits for the first batch like sync does), the ratio to sync (target: async
>= 1.5x), the fraction of each step the trainer waited for rollouts and the fraction the replica had
nothing to generate, the mean staleness, the wall time of the N steps, and the held-out reward after
N steps (``val/reward/mean``; target: within 3 points of sync). This is a measurement, never a
pass/fail test.

One run per mode moves the held-out reward by more than 3 points, so ``--seeds`` repeats every mode
at each ``trainer.seed`` given (data order, sampling and initial state all follow it) and ends with a
summary per mode: the mean ratio to sync over the seeds, the mean held-out reward and its spread, and
the held-out difference to sync at the same seed (mean, lowest, highest), in points.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

MODES = {
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off"],
    "async": ["trainer.mode=async", "rollout.max_staleness=2"],
    "async_partial": ["trainer.mode=async", "rollout.max_staleness=2", "rollout.partial_rollout=true"],
    "async_behaviour": [
        "trainer.mode=async",
        "rollout.max_staleness=2",
        "rollout.calculate_log_probs=true",
        "algorithm.off_policy=behaviour",
    ],
}


LENGTHS = {"tiny": 64, "smollm2": 48}
"""Default ``data.max_response_length`` per model: well above what most answers need (the long tail)."""


def model_overrides(name: str, path: str | None, length: int | None) -> list[str]:
    """The preset of ``name`` with the long-tailed response lengths of this benchmark."""
    from trellis.recipes.presets import preset_overrides

    length = length or LENGTHS[name]
    if name == "tiny":
        return [*preset_overrides("tiny"), f"data.max_response_length={length}"]
    overrides = [o for o in preset_overrides("demo") if not o.startswith("rollout.mode=")]
    return [*overrides, f"model.path={path}", f"data.max_response_length={length}"]


def run(
    name: str, mode: str, steps: int, root: str, path: str | None, length: int | None, seed: int | None = None
) -> dict[str, Any]:
    from trellis.config import load_config
    from trellis.trainer.ppo import Trainer

    run_dir = os.path.join(root, f"{name}-{mode}")
    config = load_config(
        overrides=[
            *model_overrides(name, path, length),
            *MODES[mode],
            *([f"trainer.seed={seed}"] if seed is not None else []),
            "rollout.mode=standalone",
            f"trainer.run_dir={run_dir}",
            "trainer.trackers=[]",
            "trainer.resume_mode=disable",
            "trainer.save_freq=-1",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.val_before_train=false",
        ]
    )
    start = time.perf_counter()
    result = Trainer(config).fit()
    wall = time.perf_counter() - start
    shutil.rmtree(run_dir, ignore_errors=True)
    later = result.history[1:]
    samples = sum(config.data.train_batch_size * config.rollout.n for _ in later)
    seconds = sum(m["timing/step"] for m in later)
    return {
        "samples_per_s": samples / seconds,
        "trainer_idle": statistics.mean(m["async/trainer_idle_fraction"] for m in later),
        "rollout_idle": statistics.mean(m["async/rollout_idle_fraction"] for m in later),
        "staleness": statistics.mean(m.get("async/staleness/mean", 0.0) for m in later),
        "response_length": statistics.mean(m["response_length/mean"] for m in later),
        "wall": wall,
        "heldout": result.validation[-1][1]["val/reward/mean"] if result.validation else float("nan"),
    }


def print_summary(results: dict[str, list[dict[str, Any]]], seeds: list[int | None]) -> None:
    """Per mode over the seeds: the mean ratio to sync, the held-out reward (mean and spread) and its
    difference to sync at the same seed, in points (mean, lowest, highest)."""
    print(f"\nover seeds {', '.join(str(s) for s in seeds)}:")
    print(
        f"{'mode':<16}{'vs sync':>9}{'held-out mean':>15}{'sd':>7}{'vs sync, points: mean':>23}"
        f"{'lowest':>8}{'highest':>9}"
    )
    for mode, rows in results.items():
        heldout = [r["heldout"] for r in rows]
        diffs = [r["heldout_diff"] for r in rows]
        print(
            f"{mode:<16}{statistics.mean(r['ratio'] for r in rows):>8.2f}x{statistics.mean(heldout):>15.3f}"
            f"{statistics.stdev(heldout):>7.3f}{statistics.mean(diffs):>+23.1f}{min(diffs):>+8.1f}"
            f"{max(diffs):>+9.1f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {list(MODES)}")
    parser.add_argument(
        "--max-response-length", type=int, default=None, help="instead of 64 (tiny) / 48 (smollm2)"
    )
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma-separated trainer.seed values: every mode at each, then a summary",
    )
    args = parser.parse_args(argv)
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [None]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or modes[0] != "sync" or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: start with sync (the baseline), then modes of {list(MODES)}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ray
    from _common import smollm2_or_note

    torch.set_num_threads(1)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="trellis-async-bench-")
    models = [m for m in args.models.split(",") if m]
    path, note = smollm2_or_note(args.no_smollm2 or "smollm2" not in models)
    try:
        for name in models:
            if name == "smollm2" and path is None:
                print(note)
                continue
            length = args.max_response_length or LENGTHS[name]
            print(
                f"\n{name}: {args.steps} steps, max_response_length {length}, 1 replica process + 1 trainer "
                "process, 1 thread each"
            )
            header = (
                ("seed  " if seeds != [None] else "")
                + f"{'mode':<16}{'samples/s':>10}{'vs sync':>9}{'trainer idle':>14}{'replica idle':>14}"
                f"{'staleness':>11}{'resp len':>10}{'wall s':>8}{'held-out':>10}"
            )
            print(header)
            results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for seed in seeds:
                baseline = None
                for mode in modes:
                    r = run(name, mode, args.steps, root, path, args.max_response_length, seed)
                    baseline = baseline or r
                    r["ratio"] = r["samples_per_s"] / baseline["samples_per_s"]
                    r["heldout_diff"] = 100 * (r["heldout"] - baseline["heldout"])
                    results[mode].append(r)
                    print(
                        (f"{seed:>4}  " if seed is not None else "")
                        + f"{mode:<16}{r['samples_per_s']:>10.1f}{r['ratio']:>8.2f}x"
                        f"{r['trainer_idle']:>14.2f}{r['rollout_idle']:>14.2f}{r['staleness']:>11.2f}"
                        f"{r['response_length']:>10.1f}{r['wall']:>8.1f}{r['heldout']:>10.3f}",
                        flush=True,
                    )
            if len(seeds) > 1:
                print_summary(results, seeds)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

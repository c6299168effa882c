"""Helpers the benchmark scripts share (not a benchmark itself: nox -s bench skips _-prefixed files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def smollm2_or_note(skip: bool) -> tuple[str | None, str]:
    """``(path, "")`` of the cached SmolLM2-135M-Instruct folder, or ``(None, why it is skipped)``."""
    if skip:
        return None, "SmolLM2 skipped (--no-smollm2)."
    try:
        from trellis.utils.demo_model import smollm2_path

        return smollm2_path(), ""
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        return None, f"SmolLM2 skipped: {exc}"


def training_only(preset: str, steps: int, name: str) -> list[str]:
    """Overrides that train ``preset`` for ``steps`` steps with no validation and no checkpoints,
    logging to jsonl under ``trainer.experiment_name=name`` (the preset's own overrides first)."""
    from trellis.recipes.presets import preset_overrides

    return [
        *preset_overrides(preset),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=-1",
        "trainer.trackers=[jsonl]",
        f"trainer.experiment_name={name}",
    ]


TIMING_KEYS = ("timing/update_actor", "timing/generate", "timing/step")
"""The per-step timings the side-by-side preset benchmarks (attention.py, micro_batch.py) compare."""


def train_and_print_timings(overrides: list[str], threads: int, label: str) -> None:
    """One side, in this process: train with ``overrides`` and print one JSON line: ``label``, the
    per-step :data:`TIMING_KEYS` and the process's peak resident set (GiB)."""
    import json

    import torch

    torch.set_num_threads(threads)
    import trellis
    from trellis.config import load_config
    from trellis.hooks import get_plugin_manager, hookimpl
    from trellis.utils.memory import GIB, peak_rss_bytes

    steps: list[dict[str, float]] = []

    class Record:
        @hookimpl
        def trellis_step_end(self, step: int, metrics: dict[str, float]) -> None:
            steps.append({key: float(metrics[key]) for key in TIMING_KEYS if key in metrics})

    record = Record()
    get_plugin_manager().register(record)
    try:
        trellis.train(load_config(None, overrides))
    finally:
        get_plugin_manager().unregister(record)
    print(json.dumps({"side": label, "steps": steps, "peak_rss_gib": peak_rss_bytes() / GIB}), flush=True)


def side_parser(description: str) -> Any:
    """An ``argparse`` parser with the options of a side-by-side preset benchmark: ``--steps``,
    ``--rounds``, ``--threads``, ``--preset`` and trailing ``key=value`` overrides; the script adds its
    own ``--side`` (the child's mode) and sides."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=4, help="steps a side and round (1st dropped)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating the order")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"])
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def run_script_side(script: str, side: str, args: Any, label: str | None = None) -> dict:
    """:func:`run_fresh_side` of ``script --side side`` with ``args``' steps, threads, preset and
    overrides (a :func:`side_parser` namespace); ``label`` names it in errors (default ``side``)."""
    import sys

    command = [sys.executable, script, "--side", side, "--steps", str(args.steps)]
    command += ["--threads", str(args.threads), "--preset", args.preset, *args.overrides]
    return run_fresh_side(command, args.threads, label or side)


def run_fresh_side(command: list[str], threads: int, label: str) -> dict:
    """Run ``command`` (a script's ``--side`` mode, which calls :func:`train_and_print_timings`) in a
    fresh process with ``threads`` OpenMP threads; its JSON line, the first step dropped (it faults the
    process's memory in)."""
    import json
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {label} side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["steps"] = result["steps"][1:]
    return result


def alternating_rounds(sides: list[str], rounds: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``run(side)`` for every side, ``rounds`` times, the sides alternating which goes first from round
    to round; per side the results in round order. Prints each run's ``update_actor`` seconds."""
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            result = run(side)
            results[side].append(result)
            update = [round(s["timing/update_actor"], 2) for s in result["steps"]]
            print(f"  round {round_ + 1} {side}: update_actor {update} s", flush=True)
    return results


def print_median_table(
    label: str, timings: dict[str, list[dict[str, float]]], peaks: dict[str, float] | None = None
) -> None:
    """A markdown table: per side the median of each of :data:`TIMING_KEYS` and its ratio to the first
    side's, then, given ``peaks``, the side's peak resident set (GiB)."""
    import statistics

    medians = {
        side: {key: statistics.median(s[key] for s in steps if key in s) for key in TIMING_KEYS}
        for side, steps in timings.items()
    }
    base = next(iter(medians.values()))
    last = " | peak RSS GiB" if peaks else ""
    print(f"| {label} | update_actor s | x base | generate s | x base | step s | x base{last} |")
    print("|---|---:|---:|---:|---:|---:|---:" + ("|---:" if peaks else "") + "|")
    for side, row in medians.items():
        cells = " | ".join(f"{row[key]:.2f} | {row[key] / base[key]:.2f}" for key in TIMING_KEYS)
        tail = f" | {peaks[side]:.2f}" if peaks else ""
        print(f"| {side} | {cells}{tail} |")


def compare_sides(
    label: str,
    sides: list[str],
    args: Any,
    run: Callable[[str], dict],
    peaks: bool = True,
    names: dict[str, str] | None = None,
) -> None:
    """Run every side ``args.rounds`` times, alternating (:func:`alternating_rounds`), then print the
    median table (:func:`print_median_table`), with each side's largest peak resident set when
    ``peaks``; ``names`` relabels sides in the table. ``args`` has ``preset``, ``steps``, ``rounds``
    and ``threads``."""
    import time

    print(f"preset {args.preset}: {args.steps} steps a side, {args.rounds} rounds, {args.threads} threads")
    start = time.perf_counter()
    results = alternating_rounds(sides, args.rounds, run)
    seconds = time.perf_counter() - start
    print(f"\nmedians over {args.rounds * (args.steps - 1)} steps a side ({seconds:.0f} s in all)")
    names = names or {}
    timings = {
        names.get(side, side): [step for r in runs for step in r["steps"]] for side, runs in results.items()
    }
    most = {names.get(side, side): max(r["peak_rss_gib"] for r in runs) for side, runs in results.items()}
    print_median_table(label, timings, most if peaks else None)

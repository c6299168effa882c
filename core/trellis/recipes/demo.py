"""The demo: SmolLM2-135M-Instruct learns short arithmetic word problems with GRPO, on a CPU.

    python -m trellis.recipes.demo [key=value ...]     # or: trellis train --preset demo

The task (:mod:`trellis.recipes.arithmetic`) is one-step word problems, scored 1 when the last
integer of the response is the answer, else 0. Responses are capped at 16 tokens, so the model must
answer briefly: out of the box SmolLM2-135M-Instruct (greedy) restates the problem at length and is
cut off before its answer, or gets the sum wrong, on over 95% of the held-out problems. GRPO teaches
it to write one short equation and stop ("Zoe has 3 + 2 = 5"), and to get more of them right.

The trainer's greedy validations before the first step and after the last measure the held-out
accuracy; :func:`main` prints both, the gain, the wall time, the peak memory and the path of the
reward curve, and during training a line per step with the process's resident memory.

Measured on 2 cores (x86-64 with AMX, torch 2.13, bf16): 40 steps of about 13 s, 9 minutes in all
with model loading and both validations; held-out accuracy went from 3.5% to 54.0%
(``trainer.seed=1``, the default) and to 57.5% (``trainer.seed=2``). On 2 cores without native bf16
(fp32, a quiet machine), after flushing denormals and running each prompt once for its 8 responses
(docs/performance.md, "Faster steps"): 40 steps of about 18 s (generation 5 s, update 12.5 s),
13 min 23 s in all, 4.0% -> 57.5%; before those two changes a step took 30 s. 16 steps at twice the
learning rate took 5 min 28 s and reached only 33.0%. With another busy process on the same two
cores, two torch threads slow down several-fold. With ``trainer.host_memory=reuse`` (the default
since; docs/performance.md "Memory"), fp32 on a busy machine: 10 min 23 s, steps of 13.3 s
(generation 4.0 s, update 9.1 s) against 18 min 35 s and 25.4 s when every stage faulted its memory
in again; 4.0% -> 59.5% either way. Memory: 4.18 GiB resident after every step (the update's
working set stays with the process), peak 4.83 GiB in the final validation at 200 rows at once,
4.37 GiB at the 128 rows the preset now allows (a 2-step probe) and 4.22 GiB over a whole run with
them (one torch thread next to another busy process: 16 min, 4.0% -> 54.5%); before malloc's heaps
were trimmed and the micro-batches shrunk, 6-11 GiB and growing. On 2 cores of an AMD EPYC with
AVX512-BF16 (bf16) and eager attention (the preset's in bf16 since; docs/performance.md, "Attention at
short lengths"): 11 min 1 s, steps of 14.7 s (generation 5.3 s, update 9.0 s), 4.0% -> 54.0%, peak
3.94 GiB; there the update took 0.80x sdpa's time in the same benchmark run. On the same machine,
with the replica's decoding attention on float32 copies, two groups a micro-batch and the start-up
heap frozen (docs/performance.md, "Micro-batches of whole groups"): 6 min 33 s, steps of 8.9 s
(generation 3.2 s, update 5.5 s), 5.0% -> 59.5%, peak 4.33 GiB. With four groups a micro-batch (the
replica's weights freed while training, the fused RMSNorm), each admission's common prompt start
prefilled once, and the replica decoding on the event loop's thread (docs/performance.md, "Decoding
on the event loop's thread"): 5 min 18 s, steps of 7.4 s (generation 2.4 s, update 4.9 s),
5.0% -> 58.0%, peak 4.58 GiB. With the replica's large weights packed for oneDNN while it decodes
(docs/performance.md, "Weights packed for oneDNN"): 5 min 2 s and 5 min 34 s in two runs on the
noisy host, steps of 6.9 and 7.1 s (generation 2.07 and 2.17 s), 5.0% -> 58.0% both, peak 4.60 GiB.
On 2 cores of an AMD EPYC with AVX2 only (float32, sdpa, two groups a micro-batch): 13 min 37 s and
12 min 55 s, steps of 17.8 s (generation 4.7 s, update 12.9 s: about 60% of the 155 GFLOP/s that
two threads' float32 matmuls reach there), 4.0% -> 57.5%, peak 4.86 / 4.87 GiB in the final
validation at 128 rows at once; with the replica capped at 64 rows in float32: 13 min 5 s,
4.0% -> 57.5%, peak 4.18 GiB (docs/performance.md, "The final validation in float32").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from trellis.hooks import get_plugin_manager, hookimpl
from trellis.recipes.arithmetic import make_problems
from trellis.recipes.presets import preset_overrides
from trellis.startup_gc import start_up_gc
from trellis.utils.memory import GIB, peak_rss_bytes, rss_bytes


def heldout_accuracy(validation: Sequence[tuple[int, dict[str, float]]]) -> tuple[float, float]:
    """``(before, after)``: held-out accuracy of the first and the last validation, in [0, 1].

    Validations are greedy with one response per problem, and the reward is 0 or 1, so the mean
    reward is the fraction of problems answered right (``val/pass@1``).

    Raises:
        ValueError: fewer than two validations (the run must validate before and after training).
    """
    if len(validation) < 2:
        raise ValueError(
            f"Need validations before and after training, got {len(validation)}; keep "
            "trainer.val_before_train true and trainer.test_freq > 0."
        )
    return validation[0][1]["val/pass@1"], validation[-1][1]["val/pass@1"]


class StepPrinter:
    """A hook module (an instance): prints one line per training step, with the process's memory.

    ``step 3/40: reward 0.125, RSS 3.10 GiB, peak RSS 4.41 GiB``: the mean reward of the step's
    samples, the resident set size at the step's end and the peak resident set size of the process
    so far. ``peaks`` keeps the peak after each step (GiB).
    """

    def __init__(self, total_steps: int | None, stream: Any = None):
        self.total_steps = total_steps
        self.stream = stream
        self.peaks: list[float] = []

    @hookimpl
    def trellis_step_end(self, step: int, metrics: dict[str, float]) -> None:
        peak = peak_rss_bytes() / GIB
        self.peaks.append(peak)
        reward = metrics.get("reward/mean", float("nan"))
        total = f"/{self.total_steps}" if self.total_steps else ""
        print(
            f"step {step}{total}: reward {reward:.3f}, RSS {rss_bytes() / GIB:.2f} GiB, "
            f"peak RSS {peak:.2f} GiB",
            file=self.stream or sys.stdout,
            flush=True,
        )


def run(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train the ``demo`` preset (with ``overrides`` on top); returns a summary.

    Returns:
        ``{"before", "after"}`` held-out accuracy (fractions), ``"heldout"`` (number of
        problems), ``"steps"``, ``"seconds"`` (wall time, model preparation included),
        ``"peak_rss_gib"`` (the process's peak resident set), ``"reward_curve"`` and ``"run_dir"``
        (paths), and ``"result"`` (the ``TrainResult``). Prints a line per step (:class:`StepPrinter`).
    """
    import trellis
    from trellis.config import load_config
    from trellis.data.dataset import read_rows

    start = time.perf_counter()
    # as trellis train does: the start-up heap frozen once the run starts, so the replica's collection
    # in each step's rollout_sleep stage walks what training made (0.2 s a step when it walked it all)
    with start_up_gc():
        config = load_config(None, [*preset_overrides("demo"), *overrides])
        printer = StepPrinter(config.trainer.total_training_steps)
        get_plugin_manager().register(printer)
        try:
            result = trellis.train(config)
        finally:
            get_plugin_manager().unregister(printer)
    seconds = time.perf_counter() - start
    before, after = heldout_accuracy(result.validation)
    return {
        "before": before,
        "after": after,
        "heldout": sum(len(read_rows(path)) for path in config.data.val_files),
        "steps": result.steps,
        "seconds": seconds,
        "peak_rss_gib": peak_rss_bytes() / GIB,
        "reward_curve": result.reward_curve,
        "run_dir": result.run_dir,
        "result": result,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The lines :func:`main` prints: accuracy before and after, gain, wall time (and peak memory, when
    the summary has it), reward curve."""
    before, after = 100 * summary["before"], 100 * summary["after"]
    count = f" ({summary['heldout']} problems)" if summary.get("heldout") else ""
    minutes, seconds = divmod(round(summary["seconds"]), 60)
    memory = [f"Peak memory: {summary['peak_rss_gib']:.2f} GiB resident"] if "peak_rss_gib" in summary else []
    return "\n".join(
        [
            f"Held-out accuracy{count}, greedy:",
            f"  before training: {before:5.1f}%",
            f"  after {summary['steps']} GRPO steps: {after:5.1f}%",
            f"  gain: {after - before:+.1f} points",
            f"Wall time: {minutes} min {seconds:02d} s",
            *memory,
            f"Reward curve: {summary['reward_curve'] or 'none'}",
            f"Run directory: {summary['run_dir']}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trellis.recipes.demo [key=value ...]``: run the demo and print its summary."""
    parser = argparse.ArgumentParser(
        prog="python -m trellis.recipes.demo",
        description="GRPO on SmolLM2-135M-Instruct with generated arithmetic word problems (CPU, 5-10 min).",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides on the preset")
    args = parser.parse_args(argv)
    print(
        "Trellis demo: SmolLM2-135M-Instruct learns arithmetic word problems with GRPO.\n"
        f"Example problem: {make_problems(1, 0)[0][0].question}",
        flush=True,
    )
    summary = run(args.overrides)
    print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

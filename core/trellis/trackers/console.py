"""``console`` tracker: a progress bar with step, reward and throughput, and a summary table at the end."""

from __future__ import annotations

import sys
from typing import Any

from trellis.trackers.base import Tracker

SUMMARY_KEYS = (
    "reward/mean",
    "score/mean",
    "val/reward/mean",
    "val/pass@1",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "perf/throughput",
    "timing/step",
)


class ConsoleTracker(Tracker):
    """Shows a ``rich`` progress bar while training (one line per step when not on a terminal) and,
    at :meth:`finish`, a table of the first and last value of the main metrics.

    Options:
        total_steps: length of the progress bar (the trainer passes it).
        stream: where to write (default stderr).
    """

    def __init__(
        self,
        run_dir: str,
        config: dict[str, Any] | None = None,
        *,
        total_steps: int | None = None,
        stream: Any = None,
        **options: Any,
    ):
        super().__init__(run_dir, config)
        from rich.console import Console

        self.console = Console(file=stream or sys.stderr, highlight=False)
        self.total_steps = total_steps
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._progress: Any = None
        self._task: Any = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        numbers = {
            k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for key, value in numbers.items():
            self.first.setdefault(key, value)
            self.last[key] = value
        parts = []
        for key, label in (
            ("reward/mean", "reward"),
            ("val/reward/mean", "val"),
            ("perf/throughput", "tok/s"),
        ):
            if key in numbers:
                parts.append(f"{label} {numbers[key]:.3g}")
        info = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            self.console.print(f"step {step}{total}  {info}")

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Print the validation samples as a table (prompt, response, score)."""
        from rich.table import Table

        table = Table(title=f"Validation samples, step {step}", show_lines=True)
        for column in ("prompt", "response", "score"):
            table.add_column(column, overflow="fold")
        for sample in samples:
            table.add_row(
                str(sample.get("prompt", "")), str(sample.get("response", "")), f"{sample['score']:.4g}"
            )
        self.console.print(table)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        keys = [k for k in SUMMARY_KEYS if k in self.last]
        if not keys:
            return
        from rich.table import Table

        table = Table(title="Run summary")
        table.add_column("metric")
        table.add_column("first", justify="right")
        table.add_column("last", justify="right")
        for key in keys:
            table.add_row(key, f"{self.first[key]:.4g}", f"{self.last[key]:.4g}")
        self.console.print(table)

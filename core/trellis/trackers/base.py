"""The tracker protocol."""

from __future__ import annotations

from typing import Any


class Tracker:
    """Receives the metrics of every step. Subclass it, or provide the same two methods.

    Trackers are constructed by the trainer as ``cls(run_dir=..., config=..., **options)``
    where ``run_dir`` is the run's output directory and ``config`` its configuration as a
    plain dict (or None), and ``options`` come from the tracker's own config section.
    """

    def __init__(self, run_dir: str, config: dict[str, Any] | None = None, **options: Any):
        self.run_dir = run_dir
        self.config = config

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (name -> number) for training step ``step``."""
        raise NotImplementedError

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Record validation samples (``trainer.log_val_generations``): each a dict with ``prompt``,
        ``response`` (text) and ``score`` (number). The base class ignores them; the built-in trackers
        write them (jsonl: ``val_generations.jsonl``; console: a table; tensorboard, wandb, mlflow)."""

    def finish(self) -> None:
        """Flush and release resources; called once at the end of the run."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

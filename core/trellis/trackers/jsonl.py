"""``jsonl`` tracker: one JSON object per step, appended to ``<run_dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from trellis.trackers.base import Tracker


class JsonlTracker(Tracker):
    """Append each step's metrics as one JSON line: ``{"step": 3, "time": ..., "reward/mean": 0.5}``.

    The file is opened in append mode, so a resumed run continues it; each line is flushed as
    it is written, so a killed run loses nothing already logged. Tensor and numpy scalars are
    stored as numbers; NaN and infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict
    JSON has no such numbers). Values that are not numbers must be strings, bools or None.

    Options:
        filename: name of the file inside ``run_dir`` (default ``metrics.jsonl``).
    """

    def __init__(
        self,
        run_dir: str,
        config: dict[str, Any] | None = None,
        *,
        filename: str = "metrics.jsonl",
        **options: Any,
    ):
        super().__init__(run_dir, config)
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, filename)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append one line for ``step``. Raises TypeError naming a metric that is not a number."""
        if self._file.closed:
            raise RuntimeError(f"JsonlTracker for {self.path!r} is finished; create a new one to log more.")
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            row[str(key)] = _jsonable(key, value)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Append one line per sample to ``<run_dir>/val_generations.jsonl``: ``{"step", "prompt",
        "response", "score"}``."""
        path = os.path.join(self.run_dir, "val_generations.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            for sample in samples:
                row = {"step": int(step), **{str(k): _jsonable(k, v) for k, v in sample.items()}}
                f.write(json.dumps(row, allow_nan=False) + "\n")

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


def _jsonable(key: Any, value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(
                f"Metric {key!r} is not a scalar (got shape {getattr(value, 'shape', '?')}); "
                "log one number per metric."
            ) from exc
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    raise TypeError(
        f"Metric {key!r} has value {value!r} of type {type(value).__name__}; "
        "log numbers, strings, bools or None."
    )

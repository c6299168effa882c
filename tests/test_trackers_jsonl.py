"""trellis.trackers.jsonl: one JSON line per step, appended and flushed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trellis.trackers.jsonl import JsonlTracker


def read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_logs_one_line_per_step_with_scalars_converted(tmp_path):
    run_dir = tmp_path / "run"
    tracker = JsonlTracker(str(run_dir))
    tracker.log(
        {
            "reward/mean": torch.tensor(0.25),
            "len": np.int64(7),
            "done": np.bool_(True),
            "note": "ok",
            "nan": float("nan"),
            "inf": -float("inf"),
        },
        step=1,
    )
    rows = read(run_dir / "metrics.jsonl")  # readable before finish(): every line is flushed
    assert len(rows) == 1 and rows[0]["time"] > 0
    del rows[0]["time"]
    assert rows == [
        {"step": 1, "reward/mean": 0.25, "len": 7, "done": True, "note": "ok", "nan": "nan", "inf": "-inf"}
    ]
    tracker.finish()
    tracker.finish()  # idempotent
    with pytest.raises(RuntimeError, match="is finished"):
        tracker.log({"x": 1}, step=2)


def test_resumed_run_appends(tmp_path):
    with JsonlTracker(str(tmp_path), filename="m.jsonl") as tracker:
        tracker.log({"x": 1.5}, step=1)
    with JsonlTracker(str(tmp_path), filename="m.jsonl") as tracker:
        tracker.log({"x": 2.5}, step=2)
    assert [(r["step"], r["x"]) for r in read(tmp_path / "m.jsonl")] == [(1, 1.5), (2, 2.5)]


def test_non_scalar_metrics_are_rejected_by_name(tmp_path):
    with JsonlTracker(str(tmp_path)) as tracker:
        with pytest.raises(
            TypeError, match=r"Metric 'hist' is not a scalar \(got shape torch.Size\(\[3\]\)\)"
        ):
            tracker.log({"hist": torch.ones(3)}, step=1)
        with pytest.raises(TypeError, match=r"Metric 'cfg' has value \{'a': 1\} of type dict"):
            tracker.log({"cfg": {"a": 1}}, step=1)
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # a rejected row writes nothing

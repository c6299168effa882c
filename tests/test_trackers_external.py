"""The optional trackers: tensorboard, wandb and mlflow, with fake packages standing in (hermetic)."""

from __future__ import annotations

import sys
import types

import pytest

from trellis.registries import trackers
from trellis.trackers.console import ConsoleTracker
from trellis.trackers.external import MlflowTracker, TensorboardTracker, WandbTracker

CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp"}}
METRICS = {"reward/mean": 0.5, "val/pass@1": 1, "note": "text", "bad": float("nan"), "flag": True}


def test_registered_by_name():
    assert trackers.get("tensorboard") is TensorboardTracker
    assert trackers.get("wandb") is WandbTracker
    assert trackers.get("mlflow") is MlflowTracker
    assert trackers.get("console") is ConsoleTracker


def test_wandb_tracker_calls(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = WandbTracker(str(tmp_path), CONFIG, mode="offline")
    tracker.log(METRICS, 3)
    tracker.finish()
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"], init["mode"]) == (
        "proj",
        "exp",
        str(tmp_path),
        "offline",
    )
    assert calls[1] == ("log", {"reward/mean": 0.5, "val/pass@1": 1.0}, 3)  # numbers only, finite
    assert calls[2] == ("finish",)


def test_mlflow_tracker_calls(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    fake.set_tracking_uri = lambda uri: calls.append(("uri", uri))
    fake.set_experiment = lambda name: calls.append(("experiment", name))
    fake.start_run = lambda run_name: calls.append(("run", run_name)) or object()
    fake.log_metrics = lambda metrics, step: calls.append(("log", metrics, step))
    fake.end_run = lambda: calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    tracker = MlflowTracker(str(tmp_path), CONFIG, tracking_uri=f"file://{tmp_path}")
    tracker.log(METRICS, 2)
    tracker.finish()
    assert calls == [
        ("uri", f"file://{tmp_path}"),
        ("experiment", "proj"),
        ("run", "exp"),
        ("log", {"reward/mean": 0.5, "val/pass_at_1": 1.0}, 2),
        ("end",),
    ]


def test_tensorboard_tracker_writes_scalars(tmp_path, monkeypatch):
    written = []

    class Writer:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, key, value, global_step):
            written.append((key, value, global_step))

        def flush(self):
            pass

        def close(self):
            written.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    tracker = TensorboardTracker(str(tmp_path))
    tracker.log(METRICS, 5)
    tracker.finish()
    assert written == [
        ("dir", str(tmp_path / "tensorboard")),
        ("reward/mean", 0.5, 5),
        ("val/pass@1", 1.0, 5),
        ("close",),
    ]


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'trellis-rl\[wandb\]'"):
        WandbTracker(str(tmp_path), CONFIG)


def test_console_tracker_prints_steps_and_a_summary(tmp_path):
    import io

    stream = io.StringIO()
    tracker = ConsoleTracker(str(tmp_path), total_steps=2, stream=stream)
    tracker.log({"reward/mean": 0.25, "perf/throughput": 1000.0}, 1)
    tracker.log({"reward/mean": 0.75, "perf/throughput": 1200.0}, 2)
    tracker.finish()
    out = stream.getvalue()
    assert "step 1/2  reward 0.25  tok/s 1e+03" in out
    assert "step 2/2  reward 0.75" in out
    assert "Run summary" in out and "reward/mean" in out and "0.75" in out

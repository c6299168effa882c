"""The optional trackers against the real packages, read back with each package's own reader.

tensorboard: the event files, through tensorboard's ``EventAccumulator``. wandb: an offline run
(no network, every wandb folder in tmp), its ``.wandb`` transaction log read by ``wandb leet
inspect`` and its service process gone after ``wandb.teardown()``. mlflow: a sqlite store (MLflow's
default backend) and a file store in tmp, through ``MlflowClient``. Each test skips, naming the
extra, where its package is missing (``pip install 'trellis-rl[trackers]'``: tensorboard, wandb,
mlflow-skinny with sqlalchemy and alembic). Stand-in modules only for the missing-package message.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from trellis.registries import trackers
from trellis.trackers.console import ConsoleTracker
from trellis.trackers.external import MlflowTracker, TensorboardTracker, WandbTracker, _mlflow_name

CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp"}, "algorithm": {"gamma": 1.0}}
METRICS = {"reward/mean": 0.5, "val/pass@1": 1, "note": "text", "bad": float("nan"), "flag": True}
SAMPLES = [
    {"prompt": "2+2? | sum", "response": "4\nyes", "score": 1.0},
    {"prompt": "3+3?", "response": "5", "score": 0.0},
]
COLUMNS = ["prompt", "response", "score"]
ROWS = [[s[c] for c in COLUMNS] for s in SAMPLES]
MISSING = "is not installed (pip install 'trellis-rl[trackers]')"


def test_registered_by_name():
    assert trackers.get("tensorboard") is TensorboardTracker
    assert trackers.get("wandb") is WandbTracker
    assert trackers.get("mlflow") is MlflowTracker
    assert trackers.get("console") is ConsoleTracker


@pytest.mark.parametrize(
    "cls, module, package",
    [
        (TensorboardTracker, "torch.utils.tensorboard", "tensorboard"),
        (WandbTracker, "wandb", "wandb"),
        (MlflowTracker, "mlflow", "mlflow"),
    ],
)
def test_missing_package_says_how_to_install(tmp_path, monkeypatch, cls, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # the import fails, as without the package
    message = rf"needs the '{package}' package: pip install 'trellis-rl\[{package}\]'"
    with pytest.raises(ImportError, match=message):
        cls(str(tmp_path), CONFIG)


# ---------------------------------------------------------------- tensorboard


def test_tensorboard_tracker_writes_scalars(tmp_path):
    """Finite numbers as scalars at their steps, the samples as a text summary; read back by
    tensorboard's own EventAccumulator."""
    pytest.importorskip("tensorboard", reason=f"tensorboard {MISSING}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorboardTracker(str(tmp_path))
    tracker.log(METRICS, 5)
    tracker.log({"reward/mean": 0.75}, 6)
    tracker.log_generations(SAMPLES, 6)
    tracker.finish()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert sorted(tags["scalars"]) == ["reward/mean", "val/pass@1"]  # no text, NaN or bool
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(5, 0.5), (6, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("val/pass@1")] == [(5, 1.0)]
    assert tags["tensors"] == ["val/generations/text_summary"]  # add_text's tag, "val/generations" in the UI
    (text,) = events.Tensors("val/generations/text_summary")
    assert text.step == 6
    assert text.tensor_proto.string_val[0].decode() == (
        "| prompt | response | score |\n|---|---|---|\n| 2+2? \\| sum | 4<br>yes | 1.0 |\n| 3+3? | 5 | 0.0 |"
    )


def test_tensorboard_tracker_log_dir_option(tmp_path):
    pytest.importorskip("tensorboard", reason=f"tensorboard {MISSING}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorboardTracker(str(tmp_path / "run"), log_dir=str(tmp_path / "tb")) as tracker:
        tracker.log({"loss": 2.0}, 1)
    assert not (tmp_path / "run" / "tensorboard").exists()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0)]


# ---------------------------------------------------------------- wandb


def _descendants() -> dict[int, str]:
    """``{pid: name}`` of this process's descendants, from /proc (empty where there is none)."""
    parent: dict[int, int] = {}
    name: dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry)
        name[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
        parent[pid] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: dict[int, str] = {}
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = name[child]
                todo.append(child)
    return found


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode with every folder it writes (runs, config, data, cache, artifacts) in
    tmp; afterwards ``wandb.teardown()`` and no wandb process left behind."""
    wandb = pytest.importorskip("wandb", reason=f"wandb {MISSING}")
    home = tmp_path / "wandb-home"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(home / "dir"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",  # leave pytest's capture of stdout alone
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    before = set(_descendants())
    try:
        yield wandb
    finally:
        wandb.teardown()  # ends the wandb-core service this process started
    deadline = time.monotonic() + 30
    while (left := {p: n for p, n in _descendants().items() if p not in before and "wandb" in n}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left, f"wandb processes left running: {left}"


def _inspect(run_dir: str, *flags: str) -> str:
    """``wandb leet inspect``: wandb's own reader of a run's ``.wandb`` transaction log."""
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", *flags, run_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "No such command" in done.stderr:
        pytest.skip(f"this wandb has no `wandb leet inspect` to read runs back: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_wandb_tracker_calls(tmp_path, wandb_offline):
    """An offline run named trainer.experiment_name in project trainer.project_name, with the
    config, the finite numbers at their steps and the samples as a table; read back from the run's
    files by wandb itself. (trainer.project_name / trainer.experiment_name are pinned here.)"""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracker = WandbTracker(str(run_dir), CONFIG)
    tracker.log(METRICS, 3)
    tracker.log({"reward/mean": 0.75}, 4)
    tracker.log_generations(SAMPLES, 4)
    tracker.finish()

    (offline,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))  # the `dir` default: the run dir
    records = [json.loads(line) for line in _inspect(offline, "--json").splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"]) == ("proj", "exp")
    config = run["config"]["update"]
    assert (config["trainer"], config["algorithm"]) == (CONFIG["trainer"], CONFIG["algorithm"])
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [3, 4]
    first, second = ({k: v for k, v in h["item"].items() if not k.startswith("_")} for h in history)
    assert first == {"reward/mean": 0.5, "val/pass@1": 1}  # numbers only, finite
    assert second["reward/mean"] == 0.75 and second["val/generations._type"] == "table-file"
    with open(os.path.join(offline, "files", second["val/generations.path"])) as f:
        table = json.load(f)
    assert (table["columns"], table["data"]) == (COLUMNS, ROWS)

    summary = json.loads(_inspect(offline, "--summary", "--json"))
    assert (summary["state"], summary["exit_code"], summary["step"]) == ("finished", 0, 4)


# ---------------------------------------------------------------- mlflow


def _mlflow_store(store: str, tmp_path, monkeypatch) -> str:
    """A tracking URI in tmp: sqlite (MLflow's default backend; needs sqlalchemy and alembic) or
    a file store (which MLflow 3 serves only with MLFLOW_ALLOW_FILE_STORE=true)."""
    pytest.importorskip("mlflow", reason=f"mlflow {MISSING}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps its artifacts in ./mlruns
    if store == "sqlite":
        for package in ("sqlalchemy", "alembic"):
            pytest.importorskip(package, reason=f"{package} {MISSING}: MLflow's sqlite store needs it")
        return f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


@pytest.fixture(params=["sqlite", "file"])
def mlflow_uri(request, tmp_path, monkeypatch):
    return _mlflow_store(request.param, tmp_path, monkeypatch)


def test_mlflow_tracker_calls(tmp_path, mlflow_uri):
    """A run named trainer.experiment_name in experiment trainer.project_name, finished, with the
    finite numbers under names MLflow accepts, at their steps, also when logged from another
    thread, and the samples as a table artifact; read back with MlflowClient.
    (trainer.project_name / trainer.experiment_name are pinned here.)"""
    import mlflow

    tracker = MlflowTracker(str(tmp_path / "run"), CONFIG, tracking_uri=mlflow_uri)
    tracker.log({**METRICS, "odd (name), x=1": 2, "timing//gen/": 0.25}, 2)
    thread = threading.Thread(target=tracker.log, args=({"reward/mean": 0.75}, 3))
    thread.start()
    thread.join()
    tracker.log_generations(SAMPLES, 3)
    tracker.finish()

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])  # the other thread's step: same run
    assert (run.info.run_name, run.info.status) == ("exp", "FINISHED")
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    assert history == {
        "reward/mean": [(2, 0.5), (3, 0.75)],
        "val/pass_at_1": [(2, 1.0)],
        "odd _name__ x_1": [(2, 2.0)],
        "timing/gen": [(2, 0.25)],
    }
    path = client.download_artifacts(run.info.run_id, "val_generations/step_3.json", str(tmp_path))
    with open(path) as f:
        assert json.load(f) == {"columns": COLUMNS, "data": ROWS}  # MLflow's table layout


@pytest.mark.parametrize(
    "key, name",
    [
        ("val/pass@4", "val/pass_at_4"),
        ("reward/mean", "reward/mean"),
        ("a b-c.d_e", "a b-c.d_e"),
        ("x:y", "x_y"),
        ("odd (name), x=1", "odd _name__ x_1"),
        ("/lead//double/", "lead/double"),
        ("a/./b/../c", "a/_/b/_/c"),
        ("", "_"),
    ],
)
def test_mlflow_names(key, name):
    assert _mlflow_name(key) == name


# ---------------------------------------------------------------- in a training run


def test_a_training_run_reaches_every_real_tracker(tmp_path, monkeypatch, wandb_offline):
    """`trainer.trackers=[jsonl,tensorboard,wandb,mlflow]` on the tiny preset (one step, validation
    before and after, two samples logged): each store holds what metrics.jsonl holds, step for
    step, and the validation samples."""
    pytest.importorskip("tensorboard", reason=f"tensorboard {MISSING}")
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import trellis
    from trellis.recipes.presets import preset_overrides

    # the trainer passes trackers no options: MLflow finds its store through the environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _mlflow_store("sqlite", tmp_path, monkeypatch))
    result = trellis.train(
        overrides=[
            *preset_overrides("tiny"), f"trainer.run_dir={tmp_path / 'run'}", "trainer.resume_mode=disable",
            "trainer.trackers=[jsonl,tensorboard,wandb,mlflow]", "trainer.total_training_steps=1",
            "trainer.test_freq=1", "trainer.log_val_generations=2", "trainer.project_name=trk",
            "trainer.experiment_name=e2e",
        ]
    )  # fmt: skip
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    expected: dict[str, list[tuple[int, float]]] = {}  # the finite numbers, per name
    for row in logged:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, int | float) and not isinstance(value, bool):
                expected.setdefault(key, []).append((row["step"], float(value)))
    assert "reward/mean" in expected and "val/pass@1" in expected

    events = EventAccumulator(os.path.join(result.run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for key, points in expected.items():
        _same([(e.step, e.value) for e in events.Scalars(key)], points, key)  # float32 in the event files

    (offline,) = glob.glob(os.path.join(result.run_dir, "wandb", "offline-run-*"))
    records = [json.loads(line) for line in _inspect(offline, "--json").splitlines() if line.strip()]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    for key, points in expected.items():
        _same([(step, history[step][key]) for step, _ in points], points, key)
    assert json.loads(_inspect(offline, "--summary", "--json"))["state"] == "finished"

    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert (run.info.run_name, run.info.status) == ("e2e", "FINISHED")
    for key, points in expected.items():
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, _mlflow_name(key))]
        _same(sorted(got), points, key)
    with open(os.path.join(result.run_dir, "val_generations.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    last = [[s[c] for c in COLUMNS] for s in samples if s["step"] == 1]
    path = client.download_artifacts(run.info.run_id, "val_generations/step_1.json", str(tmp_path))
    with open(path) as f:
        assert json.load(f)["data"] == last


def _same(got: list[tuple[int, float]], expected: list[tuple[int, float]], key: str) -> None:
    """The same steps, and the same values to float32 precision."""
    assert [step for step, _ in got] == [step for step, _ in expected], key
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6), key


# ---------------------------------------------------------------- console


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

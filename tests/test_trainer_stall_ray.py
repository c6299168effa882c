"""No silent hang on the Ray executor: a worker process SIGKILLed mid-step is reported within 30 s
with its cause and its log's last lines; a worker stuck in a stage past its deadline is reported with
the Python stack it is stuck in (dumped into its log by SIGUSR1), and the run stops with code 3.

The reward runs in the workers (``reward.placement=workers``), which is how the test reaches into a
worker process mid-step: its reward function dies or hangs there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

pytestmark = pytest.mark.distributed

REWARD = textwrap.dedent(
    """
    import os, signal, sys, time

    def dies(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        print("reward worker: about to be killed", file=sys.stderr, flush=True)
        with open(os.environ["KILLED_AT"], "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def hangs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        time.sleep(3600)
    """
)


def _train(tmp_path, command, function: str, *overrides: str):
    (tmp_path / "reward.py").write_text(REWARD)
    ray_tmp = tempfile.mkdtemp(prefix="trs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = command(
        f"{tmp_path / 'reward.py'}:{function}",
        "trainer.executor=ray",
        "reward.placement=workers",
        "reward.timeout_seconds=600",
        "trainer.total_training_steps=1",
        *overrides,
    )
    env = {
        **os.environ,
        "KILLED_AT": str(tmp_path / "killed_at"),
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": ray_tmp,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc, time.time()


def test_a_worker_killed_mid_step_is_reported_with_its_cause_and_log(tmp_path, tiny_train_command):
    proc, ended = _train(tmp_path, tiny_train_command, "dies")
    killed = float((tmp_path / "killed_at").read_text())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ended - killed < 30 + 15  # reported within 30 s; the rest is shutting Ray down
    err = proc.stderr
    assert "trellis: error: worker 0 (" in err and "died during" in err, err[-3000:]
    assert "reward worker: about to be killed" in err  # the last lines of its log


def test_a_worker_stuck_past_the_deadline_is_reported_with_its_stack(tmp_path, tiny_train_command):
    proc, _ = _train(tmp_path, tiny_train_command, "hangs", "trainer.stage_timeouts={score: 5}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    report = (tmp_path / "run" / "stall_report.txt").read_text()
    assert "Stage 'score' of step 1" in report and "== worker 0 of a RayWorkerGroup" in report
    assert "reward.py" in report and "in hangs" in report, report[-3000:]  # the worker's own stack
    # the driver shut down by itself: no call queued behind the stuck worker, no exit by the last resort
    assert "did not stop within" not in proc.stderr, proc.stderr[-3000:]
    assert "workers are killed without releasing their rollout replicas" in proc.stderr

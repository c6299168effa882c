"""Kill test, distributed: an async run (``trainer.mode=async``, a standalone replica, the replay pool
in every checkpoint) SIGKILLed at random moments and resumed trains every generated sample exactly once.

``tests/trainer_async_run.py`` logs the sample ids each step trains. A killed run's steps after its
last checkpoint are trained again by the resumed run (the same step numbers), so the run's effective
training is, per step, the last record of that step. Over those steps no sample id repeats, and
together with what the final checkpoint still holds (groups in the buffer, prompts in flight or not
yet submitted) they are exactly the samples of every group the stream numbered: none lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_checkpoint_kill_ray import AGENTS, ray_tmp, run_env, runs, wait_until_gone  # noqa: F401 - fixtures

from trellis.checkpoint.training import CheckpointManager, load_rank_file
from trellis.replay import ReplayPool

pytestmark = pytest.mark.distributed

SCRIPT = str(Path(__file__).with_name("trainer_async_run.py"))
STEPS = 12
KILLS = 3
N = 4  # rollout.n of the tiny preset
SEED = 20261203


def launch(run_dir: Path, ray_root: str, log: Path) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    env = run_env(marker, ray_root)
    proc = subprocess.Popen(
        [sys.executable, "-u", SCRIPT, str(run_dir), "--steps", str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=open(log, "ab"),  # noqa: SIM115 - the run writes it until it ends
        env=env,
        start_new_session=True,
    )
    return proc, marker


def test_killed_async_runs_train_every_sample_once(tmp_path, ray_tmp, runs):  # noqa: F811
    torch.set_num_threads(1)
    log, run_dir = tmp_path / "runs.log", tmp_path / "run"
    root = run_dir / "checkpoints"
    rng = random.Random(SEED)
    kills = []
    for attempt in range(KILLS + 1):
        proc, marker = launch(run_dir, ray_tmp, log)
        runs.append(marker)
        if attempt < KILLS:
            # kill once training is under way (a step logged after this launch), at a random moment
            start = time.monotonic()
            while time.monotonic() - start < 300 and proc.poll() is None:
                if _records(run_dir) and _records(run_dir)[-1]["pid"] == proc.pid:
                    break
                time.sleep(0.05)
            delay = rng.uniform(0.0, 1.0)
            time.sleep(delay)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            kills.append((attempt, round(delay, 3), CheckpointManager(root).steps()))
        out, _ = proc.communicate(timeout=900)
        assert not wait_until_gone(marker, 30, but=AGENTS), "a run's processes outlived it by 30 s"
        lines = out.decode().splitlines()
        if attempt == KILLS or (lines and lines[-1] == f"DONE {STEPS}"):
            assert proc.returncode == 0 and lines[-1] == f"DONE {STEPS}", log.read_text()[-4000:]
            break
    effective: dict[int, list[str]] = {}
    for record in _records(run_dir):  # a later record of a step replaces the killed run's
        effective[record["step"]] = record["ids"]
    assert sorted(effective) == list(range(1, STEPS + 1)), kills
    trained = [i for step in sorted(effective) for i in effective[step]]
    assert len(trained) == len(set(trained)) == STEPS * 8 * N, kills  # none trained twice
    final = load_rank_file(root / f"global_step_{STEPS}", 0, part="trainer")["trainer"]["stream"]
    buffered = set(ReplayPool.from_state_dict(final["buffer"]).sample_ids())
    pending = {
        f"{g}:{j}" for g in ReplayPool.from_state_dict(final["pending"]).sample_ids() for j in range(N)
    }
    numbered = {f"{g}:{j}" for g in range(final["next_group"]) for j in range(N)}
    assert set(trained) | buffered | pending == numbered, kills  # none lost
    assert not (set(trained) & buffered) and not (set(trained) & pending) and not (buffered & pending)
    print(f"\nkills (attempt, delay s, checkpoints then): {kills}")


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    return records

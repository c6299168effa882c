"""Kill test, distributed: a Ray run of two FSDP workers, SIGKILLed at random moments (also in the
middle of saves) and resumed, ends bit-identical to an uninterrupted run; no Ray process outlives
a killed driver.

``tests/trainer_checkpoint_run.py`` trains the ``tiny`` preset for ``STEPS`` steps with
``trainer.executor=ray``, two ``fsdp`` policy workers and a checkpoint every step (keeping 2);
the trainer starts its own local Ray cluster. The reference is one uninterrupted run. The trial
runs in one run folder: each restart resumes from the latest checkpoint (``resume_mode=auto``)
and is killed per ``PLAN`` (kill steps and delays from a seeded generator):

- ``shards``: inside the save of a step, a few milliseconds after it began (the workers write
  their shards): the latest checkpoint is the step before, or this one when the save won the race;
- ``publish``: every shard written, nothing published: the latest is the step before, and the
  save's temporary folder is left behind;
- ``pointer``: the new folder renamed into place, the pointer not moved: the pointer still names
  the step before, and the next run replaces the folder;
- ``time``: at a random moment of the run (Ray start-up, training, saving);

then a last restart runs to the end. Within 30 s of every kill no process of the run (the
driver's Ray cluster, its workers) may remain but Ray's two agents, which first report the dead
raylet to the dead GCS (a fixed 60 s timeout); by the end of the test those must be gone too. The
checkpoint the pointer names after every kill must verify with checksums.
The final checkpoint's shards (each worker's model, optimizer, lr schedule and step; the driver's
step, loader position, KL coefficient and RNG) must equal the reference's bit for bit. Each run's
worker calls are watched by ``DriverGuard``: no tensor crosses the driver while it saves or resumes.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_trainer_checkpoints import assert_identical

from trellis.checkpoint.training import (
    MANIFEST,
    POINTER,
    TMP_PREFIX,
    CheckpointManager,
    load_rank_file,
    verify_checkpoint,
)

pytestmark = pytest.mark.distributed

SCRIPT = str(Path(__file__).with_name("trainer_checkpoint_run.py"))
STEPS = 4
WORKERS = 2
PARTS = {"actor": WORKERS}
PLAN = ("shards", "publish", "pointer", "time")
SEED = 20261203
MARKER = "TRELLIS_KILL_TEST_RUN"
"""Set in each run's environment; Ray's processes inherit it, which is how leftovers are found."""


AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's per-node agents: when their raylet dies unexpectedly they report it to the GCS before they
exit, and wait up to 60 s (a fixed timeout) for the GCS that died with the driver."""
AGENT_GRACE_S = 120.0


@pytest.fixture
def ray_tmp():
    """A Ray temp folder of this test (short: Ray's socket paths must fit 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="trk-", dir="/tmp")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def runs():
    """The markers of the runs this test started; any process of theirs still alive at the end is
    killed (by pid), so a failing test leaves nothing behind."""
    markers: list[str] = []
    try:
        yield markers
    finally:
        for marker in markers:
            for pid in processes_of(marker):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def processes_of(marker: str) -> dict[int, str]:
    """``{pid: command}`` of the live processes whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                    found[int(entry)] = command.decode(errors="replace").strip()[:100]
        except OSError:  # gone, or not ours to read
            continue
    return found


def wait_until_gone(marker: str, timeout: float, *, but: tuple[str, ...] = ()) -> dict[int, str]:
    """Wait until the run's processes other than those whose command starts with one of ``but``
    are gone; returns what is left of those after ``timeout`` (empty: all gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {pid: cmd for pid, cmd in processes_of(marker).items() if not cmd.startswith(but)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def run_env(marker: str, ray_tmp: str) -> dict[str, str]:
    """The environment of one killable run: its marker, offline, one thread, its own Ray temp folder."""
    os.makedirs(f"{ray_tmp}/{marker[:8]}")
    env = {
        **os.environ,
        MARKER: marker,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_TMPDIR": f"{ray_tmp}/{marker[:8]}",  # each run's Ray session and sockets apart
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    return env


def launch(run_dir: Path, ray_tmp: str, log: Path, kill: str | None = None) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    env = run_env(marker, ray_tmp)
    command = [sys.executable, "-u", SCRIPT, str(run_dir), "--steps", str(STEPS)]
    if kill:
        command += ["--kill", kill]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=open(log, "ab"),  # noqa: SIM115 - the run writes it until it ends
        env=env,
        start_new_session=True,  # a kill of the driver alone: its Ray processes must follow on their own
    )
    return proc, marker


def finish(proc: subprocess.Popen, kill_after: float | None = None) -> tuple[int, list[str]]:
    """Wait for the run (SIGKILL its driver ``kill_after`` seconds from now); (exit code, stdout lines)."""
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    return proc.returncode, out.decode().splitlines()


def latest_step(root: Path) -> int | None:
    """The step of the checkpoint the pointer names, verified with checksums; None without one."""
    latest = CheckpointManager(root, parts=PARTS).latest()
    if latest is None:
        return None
    manifest = verify_checkpoint(latest, parts=PARTS, checksums=True)
    assert manifest["parts"] == {"actor": WORKERS, "trainer": 1}
    saved = load_rank_file(latest, 0, part="trainer")["trainer"]["step"]
    assert latest.endswith(f"global_step_{saved}") and manifest["step"] == saved
    return saved


def test_killed_ray_runs_resume_bit_identically(tmp_path, ray_tmp, runs):
    torch.set_num_threads(1)
    log = tmp_path / "runs.log"

    started = time.monotonic()
    proc, marker = launch(tmp_path / "reference", ray_tmp, log)
    runs.append(marker)
    code, lines = finish(proc)
    duration = time.monotonic() - started
    assert code == 0, log.read_text()[-4000:]
    assert lines[-1] == f"DONE {STEPS}" and [f"SAVED {s}" for s in range(1, STEPS + 1)] == [
        line for line in lines if line.startswith("SAVED")
    ]
    assert not wait_until_gone(marker, 30), "a finished run left processes"
    reference = tmp_path / "reference" / "checkpoints"
    assert CheckpointManager(reference).steps() == [STEPS - 1, STEPS]  # pruned to 2

    rng = random.Random(SEED)
    run_dir, root = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    latest, history, ended = None, [], {}
    for phase in (*PLAN, None):
        kill = kill_after = None
        if phase == "time":
            kill_after = rng.uniform(0.2, 0.8) * duration
        elif phase is not None:
            target = rng.randint((latest or 0) + 1, STEPS)
            kill = f"{phase}:{target}:{rng.uniform(0.0, 0.05):.4f}"
        proc, marker = launch(run_dir, ray_tmp, log, kill)
        runs.append(marker)
        code, lines = finish(proc, kill_after)
        ended[marker] = time.monotonic()
        history.append((phase, kill, kill_after, code, lines))
        context = f"{history}\n{log.read_text()[-4000:]}"
        # the driver's Ray cluster and its workers die with it (the agents may take a minute, below)
        left = wait_until_gone(marker, 30, but=AGENTS)
        assert not left, f"a killed run's processes outlived it by 30 s: {left}\n{context}"
        previous, latest = latest, latest_step(root)
        if phase is None:
            assert code == 0 and lines[-1] == f"DONE {STEPS}", context
            break
        assert (previous or 0) <= (latest or 0), context  # no finished save is ever lost
        if phase == "time":
            assert code in (0, -signal.SIGKILL), context
            continue
        assert code == -signal.SIGKILL, context
        before = target - 1 or None
        if phase == "shards":
            assert latest in (before, target), context
        elif phase == "publish":
            assert latest == before, context
            assert (root / f"{TMP_PREFIX}global_step_{target}" / "actor" / "rank_1.pt").exists(), context
        else:  # pointer: the folder is complete and in place, but not named
            assert latest == before, context
            assert (root / f"global_step_{target}" / MANIFEST).exists(), context
            assert (root / POINTER).exists() == (before is not None), context

    # the end: the same checkpoints, and no leftovers of the killed saves
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in reference.iterdir()), history
    final = f"global_step_{STEPS}"
    for part, ranks in {**PARTS, "trainer": 1}.items():
        for rank in range(ranks):
            mine = load_rank_file(root / final, rank, part=part)
            theirs = load_rank_file(reference / final, rank, part=part)
            if part != "trainer":
                # A Ray worker's global generators start from the OS's entropy (nothing seeds them; the
                # driver's are seeded), so two runs' worker RNG states differ with or without kills; a
                # worker restores its own from its shard, which tests/test_trainer_checkpoints.py pins.
                assert mine.keys() == theirs.keys() == {part, "rng"}
                mine, theirs = mine[part], theirs[part]
            assert_identical(mine, theirs, f"{part}/rank_{rank}")
    actor = load_rank_file(root / final, 0, part="actor")["actor"]
    assert actor["engine"] == "fsdp" and actor["dp_size"] == WORKERS and actor["global_step"] == STEPS
    assert actor["optimizer"]["state"], "the optimizer state is compared too"
    # and nothing of any run outlives it: the agents exit too, once their report to the dead GCS fails
    for marker, end in ended.items():
        left = wait_until_gone(marker, max(0.0, end + AGENT_GRACE_S - time.monotonic()))
        assert not left, f"processes outlived their run by {AGENT_GRACE_S:g} s: {left}\n{history}"
    print(f"\nreference run {duration:.0f} s; kills: {[(p, k, a, c) for p, k, a, c, _ in history]}")

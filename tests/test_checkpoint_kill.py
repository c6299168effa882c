"""Kill test: a training run SIGKILLed at random moments always resumes, and ends bit-identical.

``tests/checkpoint_run.py`` trains the tiny model for ``STEPS`` steps, checkpointing every step
(keeping 2). The reference is one uninterrupted run in a fresh interpreter. Then ``TRIALS``
trials each start the run in a fresh checkpoint folder and kill it with SIGKILL up to
``len(KILL_PLAN)`` times, restarting it (``resume_mode=auto``) after each kill, and let the last
restart finish. The kill moments come from a seeded generator. A ``"save"`` kill picks one of
the saves the run will make; the run pauses as that save begins until the test opens a gate (a
named pipe), and the test kills it ``uniform(0, median save time)`` later, so kills hit
every phase of a save (rank file, manifest, rename, pointer, pruning) and some land just after.
A ``"time"`` kill lands at a random time after the fork (while the run loads, trains or saves).
After every kill the checkpoint the pointer names must load (checksums verified), and be no
older than the last save the run finished. Each trial's final weights, tracker run id and next
random draws must equal the reference's exactly.

The runs are forked from a server process that imported torch and transformers once, so a run
costs a fraction of a second instead of an interpreter start; each is still its own process.
"""

from __future__ import annotations

import errno
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trellis.checkpoint.training import TMP_PREFIX, CheckpointManager

SCRIPT = str(Path(__file__).with_name("checkpoint_run.py"))
STEPS = 10
TRIALS = 10
KILL_PLAN = ("save", "save", "time")
SEED = 20240611
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


class Lines:
    """Lines from a pipe, each stamped with the time it was read; reads with a deadline."""

    def __init__(self, stream):
        self.fd, self.buffer = stream.fileno(), b""

    def next(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise TimeoutError(f"no line within {timeout} s (so far: {self.buffer[-200:]!r})")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError(f"the process closed its output (so far: {self.buffer[-200:]!r})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def ready(self) -> bool:
        return b"\n" in self.buffer or bool(select.select([self.fd], [], [], 0)[0])


class Server:
    """``checkpoint_run.py serve``: forks one run per request."""

    def __init__(self, log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),  # noqa: SIM115 - the server writes it until closed
            env=ENV,
        )
        self.lines = Lines(self.proc.stdout)
        self.running: int | None = None  # the pid of the run whose EXIT has not been read

    def wait_ready(self) -> None:
        line = self.lines.next(timeout=120)
        assert line == "READY", f"{line!r}\n{self.log.read_text()[-3000:]}"

    def start(self, **kwargs) -> int:
        self.proc.stdin.write((json.dumps(kwargs) + "\n").encode())
        self.proc.stdin.flush()
        line = self.lines.next()
        assert line.startswith("PID "), line
        self.running = int(line.split()[1])
        return self.running

    def close(self) -> None:
        if self.running is not None:  # a test failed mid-run: its run is not reaped yet, so still ours
            os.kill(self.running, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def open_gate(path: str, timeout: float = 30.0) -> None:
    """Write the byte the run waits for on the named pipe ``path`` (waiting for it to listen)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: the run has not opened its end yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.0005)
            continue
        os.write(fd, b"g")
        os.close(fd)
        return


def run_once(
    server: Server, kwargs: dict, mode: str | None, rng: random.Random, timing: dict, resumed: int, last: int
):
    """One process of a trial: start it, kill it per ``mode`` (None: let it finish).

    ``"save"`` picks a save the run will make (after step ``resumed``, which it resumes from, up
    to step ``last``), lets it start through the gate, and kills it ``uniform(0, save duration)``
    later; ``"time"`` kills it ``uniform(0, 0.8 × run duration)`` after the fork.

    Returns a record: ``start`` step, ``run_id``, ``exit`` code, the ``saves_begun`` /
    ``saves_done`` step lists, ``killed`` (the kill ended it) and the ``times`` lines were read.
    """
    began = time.monotonic()
    target = None
    if mode == "save" and resumed < last:
        target = rng.randint(resumed + 1, last)
        kwargs = {**kwargs, "gate_step": target}
    else:
        kwargs = {key: value for key, value in kwargs.items() if key != "gate"}
    kill_at = began + rng.uniform(0.0, 0.8 * timing["run"]) if mode == "time" else None
    pid = server.start(**kwargs)
    record = {
        "start": None,
        "run_id": None,
        "saves_begun": [],
        "saves_done": [],
        "killed": False,
        "times": {},
    }
    while True:
        if kill_at is not None and not server.lines.ready():
            wait = kill_at - time.monotonic()
            if wait <= 0 or not select.select([server.lines.fd], [], [], wait)[0]:
                os.kill(pid, signal.SIGKILL)
                record["killed"], kill_at = True, None
                continue
        line = server.lines.next()
        kind, *rest = line.split()
        record["times"][line] = time.monotonic()
        if kind == "START":
            record["start"], record["run_id"] = int(rest[0]), rest[1]
        elif kind == "SAVE_BEGIN":
            record["saves_begun"].append(int(rest[0]))
            if target == int(rest[0]):
                open_gate(kwargs["gate"])  # the run waits for it to start this save
                time.sleep(rng.uniform(0.0, timing["save"]))
                os.kill(pid, signal.SIGKILL)
                record["killed"] = True
        elif kind == "SAVE_END":
            record["saves_done"].append(int(rest[0]))
        elif kind == "EXIT":
            assert int(rest[0]) == pid, line
            record["exit"], server.running = int(rest[1]), None
            record["killed"] = record["exit"] == -signal.SIGKILL  # a kill after the end changes nothing
            return record


def final_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())  # safe_open is not iterable
        return {key: f.get_tensor(key) for key in names}, f.metadata()


@pytest.fixture(scope="module")
def reference(tiny_model_path, tmp_path_factory):
    """The uninterrupted run, in a fresh interpreter; (weights, metadata)."""
    folder = tmp_path_factory.mktemp("reference")
    done = subprocess.run(
        [sys.executable, "-u", SCRIPT, "run", "--model", tiny_model_path, "--root", str(folder / "ckpt"),
         "--out", str(folder / "final.safetensors"), "--steps", str(STEPS)],
        capture_output=True, text=True, timeout=180, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("START 0 ")
    assert done.stdout.splitlines()[-1] == "DONE"
    weights, metadata = final_state(folder / "final.safetensors")
    assert metadata["steps"] == str(STEPS)
    assert CheckpointManager(folder / "ckpt").steps() == [STEPS - 1, STEPS]  # pruned to 2
    return weights, metadata


@pytest.mark.distributed  # dozens of runs forked and SIGKILLed (~50 s)
def test_killed_runs_resume_bit_identically(reference, tiny_model_path, tmp_path):
    ref_weights, ref_meta = reference
    server = Server(tmp_path / "server.log")
    try:
        server.wait_ready()
        rng = random.Random(SEED)

        # an uninterrupted forked run: equals the fresh interpreter's, and gives the timings
        control = tmp_path / "control"
        kwargs = {"model": tiny_model_path, "root": str(control / "ckpt"), "out": str(control / "final.st")}
        started = time.monotonic()
        record = run_once(server, kwargs, None, rng, {}, 0, STEPS)
        assert record["exit"] == 0, server.log.read_text()[-3000:]
        times = record["times"]
        saves = [times[f"SAVE_END {n}"] - times[f"SAVE_BEGIN {n}"] for n in range(1, STEPS + 1)]
        timing = {"run": time.monotonic() - started, "save": statistics.median(saves)}
        weights, metadata = final_state(control / "final.st")
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
        assert json.loads(metadata["draws"]) == json.loads(ref_meta["draws"])

        gate = tmp_path / "gate"
        os.mkfifo(gate)
        kills = during_save = interrupted_saves = 0
        for trial in range(TRIALS):
            root = tmp_path / f"trial{trial}"
            kwargs = {
                "model": tiny_model_path,
                "root": str(root / "ckpt"),
                "out": str(root / "final.st"),
                "gate": str(gate),
            }
            plan, run_ids, log = list(KILL_PLAN), set(), []
            previous = 0  # the step of the latest checkpoint after the last kill
            while True:
                mode = plan.pop(0) if plan else None
                # the first kill of a trial is in a save of the first half, so it cannot miss; later
                # ones may hit the last save too (and miss, when the run ends first)
                last = STEPS // 2 if not log else STEPS
                record = run_once(server, kwargs, mode, rng, timing, previous, last)
                log.append((mode, record))
                if record["run_id"] is not None:  # None: killed before it said
                    run_ids.add(record["run_id"])
                context = f"trial {trial}: {log}\n{server.log.read_text()[-3000:]}"
                if not record["killed"]:
                    assert record["exit"] == 0, context
                    break
                assert record["exit"] == -signal.SIGKILL, context
                kills += 1
                begun, done = record["saves_begun"], record["saves_done"]
                in_save = bool(begun) and (not done or done[-1] != begun[-1])
                during_save += in_save
                # whatever was interrupted, the checkpoint the pointer names loads, checksums and all,
                # and no finished save was lost
                manager = CheckpointManager(root / "ckpt", max_to_keep=2)
                latest = manager.latest()
                interrupted_saves += in_save and any(
                    p.name.startswith(TMP_PREFIX) for p in (root / "ckpt").glob(".*")
                )
                if latest is None:
                    assert not done and previous == 0, context
                    continue
                states = manager.load(latest)
                saved = states["trainer"]["step"]
                assert latest.endswith(f"global_step_{saved}")
                assert (done[-1] if done else previous) <= saved <= max([*begun, previous]), context
                previous = saved
            assert len(log) >= 2, f"trial {trial}: never killed: {log}"
            # a run killed before its first checkpoint starts afresh, with a new run id; resumed runs
            # keep the id of the run that made the first checkpoint, to the end
            resumed_ids = {record["run_id"] for _, record in log if record["start"]}
            weights, metadata = final_state(root / "final.st")
            assert weights.keys() == ref_weights.keys()
            for key, tensor in ref_weights.items():
                assert torch.equal(weights[key], tensor), f"trial {trial}: {key} differs from the reference"
            assert json.loads(metadata["draws"]) == json.loads(ref_meta["draws"]), f"trial {trial}"
            assert metadata["run_id"] in run_ids and resumed_ids <= {metadata["run_id"]}, (
                f"trial {trial}: {log}"
            )
    finally:
        server.close()
    print(f"\n{kills} kills, {during_save} during a save ({interrupted_saves} left a temporary folder)")
    # a planned kill misses when the run ends first (a time past its end, a save of the last step)
    assert kills >= 3 * TRIALS // 2
    assert during_save >= TRIALS // 2, f"only {during_save} of {kills} kills landed during a save"

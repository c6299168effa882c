"""Launching the ranks of a multi-process test: fresh interpreters on loopback, one gloo group.

A test module defines a worker ``_worker(rank, port, *args)`` that opens ``init_gloo(...)``, computes
and saves ``rank{rank}.pt``; its fixture calls ``run_ranks("test_module", world, *args)`` and then
``load_results(out_dir, world)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch

TESTS_DIR = str(Path(__file__).parent)
LOG_TAIL = 4000
"""Characters of a failed rank's output that the assertion shows."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``init_method="tcp://..."``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    module: str,
    world: int,
    *args,
    timeout: float = 180,
    func: str = "_worker",
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``<module>.<func>(rank, port, *args)`` for every rank in ``world`` fresh interpreters.

    ``module`` is a module of the tests folder; ``args`` travel by ``repr`` (paths become strings),
    so they must be literals: strings, numbers, and lists or dicts of them. Each rank runs with one
    OpenMP thread and Hugging Face offline, plus ``env``. Waits up to ``timeout`` seconds for each
    rank, kills any left running, and fails naming the first rank that exited non-zero with the
    tail of its output. Returns each rank's output (stdout and stderr together).
    """
    port = free_port()
    literals = ", ".join(repr(os.fspath(a) if isinstance(a, os.PathLike) else a) for a in args)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            # a rank that returned leaves at once (os._exit, after flushing its output): interpreter
            # finalisation could still run the destructor of a gloo thread that is joinable while its
            # peer tears the group down, and abort the rank (exit -6, "terminate called without an
            # active exception") after its work had succeeded
            code = (
                f"import os, sys; sys.path.insert(0, {TESTS_DIR!r}); import {module} as t; "
                f"t.{func}({rank}, {port}, {literals}); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        logs = [proc.communicate(timeout=timeout)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed (exit {proc.returncode}):\n{log[-LOG_TAIL:]}"
    return logs


@contextlib.contextmanager
def init_gloo(rank: int, port: int, world: int, timeout_s: float) -> Iterator[None]:
    """Inside a worker: one torch thread and the gloo group of ``world`` ranks on ``port``, destroyed
    on exit after a barrier when the body succeeded. ``timeout_s`` bounds each collective (the barrier
    too), so a rank whose peer died fails instead of hanging."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
        dist.barrier()  # the ranks leave together: none tears its connections down under a peer's last call
    finally:
        dist.destroy_process_group()


def load_results(out_dir: str | os.PathLike, world: int) -> list:
    """The ``rank{rank}.pt`` files the workers saved in ``out_dir``, in rank order."""
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]

"""A trainer run for the checkpoint tests, and the guard that keeps training state out of the driver.

Used by ``tests/test_checkpoint_kill_ray.py``; run from the repository root:

    python tests/trainer_checkpoint_run.py RUN_DIR --steps 4 [--kill PHASE:STEP[:DELAY]]

trains the ``tiny`` preset with two Ray workers (``actor.engine=fsdp``, ``trainer.executor=ray``;
the trainer starts its own local Ray cluster), checkpointing every step and keeping 2, resuming
from the latest checkpoint (``resume_mode=auto``). ``--kill`` makes the run SIGKILL itself inside
the save of step ``STEP``:

- ``shards``: ``DELAY`` seconds after the save began, while the workers write their shards;
- ``publish``: once every shard is written, before the manifest;
- ``pointer``: once the checkpoint folder is renamed into place, before the pointer moves.

Markers on stdout, one line each: ``STEP <step>`` (trained), ``SAVED <step>``, ``DONE <steps>``.

:class:`DriverGuard` wraps the worker groups: a tensor (or numpy array) among the arguments or
results of a worker call made while the trainer saves or resumes fails the run (it is installed
here and by ``tests/test_trainer_checkpoints.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any, ClassVar


def tensors_in(value: Any, where: str = "") -> list[str]:
    """Where ``value`` holds a tensor, an array or a DataProto (paths like ``[0]['model']``)."""
    import numpy as np
    import torch

    from trellis.data.protocol import DataProto

    if isinstance(value, torch.Tensor | np.ndarray | DataProto):
        return [where or "<value>"]
    if isinstance(value, Mapping):
        return [hit for key, item in value.items() for hit in tensors_in(item, f"{where}[{key!r}]")]
    if isinstance(value, list | tuple | set | frozenset):
        return [hit for i, item in enumerate(value) for hit in tensors_in(item, f"{where}[{i}]")]
    return []


class DriverGuard:
    """A worker group seen through a checkpoint guard.

    While :attr:`stage` is set (``"save"`` or ``"resume"``), every call is recorded in ``calls``
    as ``(stage, group name, method, result)``, and one with a tensor among its arguments or its
    result raises AssertionError naming the method and where the tensor was.
    """

    stage: ClassVar[str | None] = None
    calls: ClassVar[list[tuple[str, str, str, Any]]] = []

    def __init__(self, group: Any, name: str):
        self._group, self._name = group, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._group, attr)
        if attr.startswith("_") or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            stage = DriverGuard.stage
            if stage is not None:
                sent = tensors_in((args, kwargs))
                assert not sent, f"{self._name}.{attr} was sent tensors during {stage}: {sent}"
            result = value(*args, **kwargs)
            if stage is not None:
                DriverGuard.calls.append((stage, self._name, attr, result))
                back = tensors_in(result)
                assert not back, f"{self._name}.{attr} returned tensors to the driver during {stage}: {back}"
            return result

        return call


def install_guard(patch: Any = setattr) -> None:
    """Wrap the trainer's worker groups in :class:`DriverGuard` and mark its save and resume stages.

    ``patch(Trainer, name, function)`` sets the methods (a test passes ``monkeypatch.setattr``).
    """
    from trellis.trainer.ppo import Trainer

    build, save, resume = Trainer._build_workers, Trainer._save_checkpoint, Trainer._resume

    def build_workers(self: Any) -> None:
        build(self)
        self.actor_wg = DriverGuard(self.actor_wg, "actor_wg")
        if self.critic_wg is not None:
            self.critic_wg = DriverGuard(self.critic_wg, "critic_wg")

    def staged(stage: str, method: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            DriverGuard.stage = stage
            try:
                return method(self, *args)
            finally:
                DriverGuard.stage = None

        return run

    patch(Trainer, "_build_workers", build_workers)
    patch(Trainer, "_save_checkpoint", staged("save", save))
    patch(Trainer, "_resume", staged("resume", resume))


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())


def install_kill(phase: str, step: int, delay: float) -> None:
    """SIGKILL this process at ``phase`` of the save of ``step`` (see the module docstring)."""
    from trellis.checkpoint.training import CheckpointManager

    begin, publish, set_pointer = (
        CheckpointManager.begin,
        CheckpointManager.publish,
        CheckpointManager._set_pointer,
    )

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def begin_then_kill(self: Any, at: int) -> str:
        path = begin(self, at)
        if phase == "shards" and at == step:
            threading.Timer(delay, die).start()
        return path

    def kill_before_publish(self: Any, at: int, *args: Any, **kwargs: Any) -> str:
        if phase == "publish" and at == step:
            die()
        return publish(self, at, *args, **kwargs)

    def kill_before_pointer(self: Any, at: int | None) -> None:
        # publish sets the pointer once the folder is renamed (and before, only when it replaces a
        # folder the pointer names): kill at the move to the new step
        if phase == "pointer" and at == step and self._store.exists(f"global_step_{step}"):
            die()
        set_pointer(self, at)

    CheckpointManager.begin = begin_then_kill  # type: ignore[method-assign]
    CheckpointManager.publish = kill_before_publish  # type: ignore[method-assign]
    CheckpointManager._set_pointer = kill_before_pointer  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill", default=None, help="PHASE:STEP[:DELAY]")
    args = parser.parse_args(argv)

    import ray._private.services
    import torch

    import trellis
    from trellis.hooks import get_plugin_manager, hookimpl
    from trellis.recipes.presets import preset_overrides

    torch.set_num_threads(1)

    # Ray's address="auto" joins any Ray cluster running on the machine (another test session's);
    # this run must start its own, as on a machine without one, so that it dies with the driver
    def no_other_cluster() -> list[str]:
        return []

    no_other_cluster.cache_clear = lambda: None  # type: ignore[attr-defined]
    ray._private.services.find_gcs_addresses = no_other_cluster
    install_guard()
    if args.kill:
        phase, step, *delay = args.kill.split(":")
        install_kill(phase, int(step), float(delay[0]) if delay else 0.0)

    class Markers:
        @hookimpl
        def trellis_step_end(self, step: int, metrics: dict[str, float]) -> None:
            emit(f"STEP {step}")

        @hookimpl
        def trellis_checkpoint_saved(self, step: int, path: str) -> None:
            emit(f"SAVED {step}")

    get_plugin_manager().register(Markers())
    overrides = [
        *preset_overrides("tiny"),
        f"trainer.run_dir={args.run_dir}",
        "trainer.executor=ray",
        "trainer.n_devices_per_node=2",
        "actor.engine=fsdp",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        "trainer.resume_mode=auto",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.trackers=[jsonl]",
    ]
    result = trellis.train(overrides=overrides)
    # a run saves or resumes (or both): the guard saw those calls
    assert DriverGuard.calls, "no worker call went through the guard: was it installed?"
    emit(f"DONE {result.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

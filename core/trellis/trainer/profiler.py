"""``trainer.profile``: chosen stages of chosen steps, each run under the torch profiler.

The trainer enters every stage of a step through ``Trainer._stage``, which enters
:meth:`StageProfiler.stage`. For a stage named in ``trainer.profile.stages`` (null: all but ``step``) of a
step in ``trainer.profile.steps``, it

- starts the torch profiler in the driver, recording every thread of the process (the ``hf`` replica
  generates in a helper thread), and with ``trainer.executor=ray`` in every worker process too;
- runs the stage; its ``marked_timer`` range, and the workers' calls, show in the trace;
- writes ``<run_dir>/profile/step_<N>/<stage>.json`` (Chrome trace: Perfetto, chrome://tracing) and
  ``<stage>.txt`` (the top ``trainer.profile.top_k`` operators by self CPU time, and by self device
  time when the profile recorded a device), and logs the table (logger ``trellis.trainer.profiler``);
  each Ray worker writes ``<stage>.rank<R>.json`` / ``.txt`` (``<stage>.<pool>.rank<R>`` when the roles
  run on several resource pools), and the table of rank 0 is logged too.

One profiler runs at a time (torch allows one per process): a stage entered while another is profiled is
part of that one's trace (``generate_baseline`` within ``generate``), and ``step``, which encloses every
other stage, is profiled only when named alone (the config refuses it beside others). Processes the
trainer does not drive as worker groups (standalone replicas and their agent workers, an async reward
manager's scoring processes) are not traced: the driver's trace shows the wait for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from trellis.config.schema import ProfileConfig
from trellis.utils import fs
from trellis.utils.profiling import start_profiler, write_profile

logger = logging.getLogger(__name__)


class StageProfiler:
    """The profiler of ``trainer.profile`` (see the module docstring).

    Args:
        config: the ``trainer.profile`` section.
        run_dir: where ``profile/`` goes: a local path or an fsspec URL (written locally, then copied).
    """

    def __init__(self, config: ProfileConfig, run_dir: str) -> None:
        self.steps = frozenset(int(step) for step in config.steps)
        self.stages = frozenset(config.profiled_stages())
        self.top_k = int(config.top_k)
        self.record_shapes = bool(config.record_shapes)
        self.root = _join(run_dir, "profile")
        self._busy = threading.Lock()  # held while a stage is profiled: one profiler per process

    @property
    def enabled(self) -> bool:
        """Whether any step is profiled."""
        return bool(self.steps)

    def check_run(self, total_steps: int, *, standalone: bool = False) -> None:
        """Warn (once, at the start of a run of ``total_steps`` steps) about steps past its end, and that
        ``standalone`` replicas (processes of their own) are not traced."""
        beyond = sorted(step for step in self.steps if step > total_steps)
        if beyond:
            logger.warning(
                "trainer.profile.steps %s are past the end of this run (%d steps): they are not profiled.",
                beyond,
                total_steps,
            )
        if self.enabled and standalone:
            logger.warning(
                "trainer.profile: the standalone replicas and agent workers run in processes the trainer "
                "does not profile; the generate stage's trace shows the driver's side (the wait for them)."
            )

    def folder(self, step: int) -> str:
        """Where step ``step``'s profiles go: ``<run_dir>/profile/step_<step>``."""
        return _join(self.root, f"step_{step}")

    @contextlib.contextmanager
    def stage(self, name: str, step: int, groups: Sequence[Any] = ()) -> Iterator[None]:
        """Run the block (stage ``name`` of step ``step``) under the profiler when ``trainer.profile``
        asks for it; otherwise (or while another stage is profiled) just run it.

        ``groups``: worker groups whose workers run in processes of their own (Ray): each worker profiles
        its part of the stage. A profile is written also when the stage raised (the workers' are not:
        a failed or stuck worker could not answer); a profile that cannot be written is logged, never
        fails the run.
        """
        if step not in self.steps or name not in self.stages or not self._busy.acquire(blocking=False):
            yield
            return
        title = f"Stage {name!r} of step {step}"
        try:
            prof, started = self._start(name, step, groups)
            failed = True
            try:
                yield
                failed = False
            finally:
                if prof is not None:
                    self._write(prof, name, step, title)
                if not failed:
                    self._collect(started, name, step, title)
        finally:
            self._busy.release()

    def _start(self, name: str, step: int, groups: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Start the workers' profilers, then the driver's: ``(driver profiler, groups started)``; a
        profiler that cannot start is logged, and the stage runs without it."""
        started: list[Any] = []
        try:
            for group in groups:
                group.start_profiling(record_shapes=self.record_shapes)
                started.append(group)
            return start_profiler(record_shapes=self.record_shapes), started
        except Exception:
            logger.exception("trainer.profile: could not start profiling stage %r of step %d.", name, step)
            return None, started

    def _write(self, prof: Any, name: str, step: int, title: str) -> None:
        """Stop the driver's profiler and write its trace and table."""
        try:
            prof.stop()
            report = write_profile(prof, self.folder(step), name, top_k=self.top_k, title=f"{title} (driver)")
        except Exception:
            logger.exception(
                "trainer.profile: could not write the profile of stage %r of step %d.", name, step
            )
            return
        logger.info("%s\nTrace: %s", report.table, report.trace_path)

    def _collect(self, groups: Sequence[Any], name: str, step: int, title: str) -> None:
        for index, group in enumerate(groups):
            stem = name if len(groups) == 1 else f"{name}.{_pool_name(group, index)}"
            try:
                reports = group.stop_profiling(self.folder(step), stem, top_k=self.top_k, title=title)
            except Exception:
                logger.exception("trainer.profile: the workers could not write their profiles of %r.", name)
                continue
            if reports and reports[0] is not None:
                logger.info("%s\nTrace: %s", reports[0].table, reports[0].trace_path)


def _join(base: str, name: str) -> str:
    """``base/name``, ``base`` a local path or a URL."""
    return f"{base.rstrip('/')}/{name}" if fs.is_non_local(base) else os.path.join(base, name)


def _pool_name(group: Any, index: int) -> str:
    """The resource pool a Ray group runs on (``global_pool``, ``critic_pool``), else ``group<index>``."""
    name = getattr(getattr(group, "resource_pool", None), "name_prefix", None)
    return str(name) if name else f"group{index}"

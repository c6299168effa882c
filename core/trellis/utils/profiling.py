"""Profile a block of code with the torch profiler and keep its Chrome trace."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from trellis.utils.logging import get_rank

ACTIVITY_NAMES = ("cpu", "cuda", "xpu", "mtia")


@dataclass
class ProfileHandle:
    """What ``with profile(...) as handle`` gives.

    Attributes:
        profiler: the running ``torch.profiler.profile``, or None when profiling is disabled.
        trace_path: where the Chrome trace was written; set when the block exits (None when
            disabled).
    """

    profiler: Any = None
    trace_path: str | None = None

    def step(self) -> None:
        """Forward to ``profiler.step()`` (for a ``schedule=``); does nothing when disabled."""
        if self.profiler is not None:
            self.profiler.step()


@contextlib.contextmanager
def profile(
    output_dir: str | os.PathLike[str],
    *,
    activities: Iterable[Any] | None = None,
    record_shapes: bool = False,
    with_stack: bool = False,
    profile_memory: bool = False,
    enabled: bool = True,
    filename: str | None = None,
    **profiler_kwargs: Any,
) -> Iterator[ProfileHandle]:
    """Run the block under ``torch.profiler.profile`` and write its Chrome trace into ``output_dir``.

    The trace is ``<output_dir>/<filename>``, by default
    ``trace_rank<rank>_pid<pid>_<time ns>.json`` (a name ending in ``.gz`` is gzipped); open it
    in Perfetto or ``chrome://tracing``. It is written when the block exits, also when the
    block raised. ``output_dir`` may be a URL (see :mod:`trellis.utils.fs`): the trace is
    written locally first, then copied there.

    Args:
        activities: what to record: ``torch.profiler.ProfilerActivity`` values or the names
            ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mtia"``. Default: CPU, plus CUDA when available.
        record_shapes, with_stack, profile_memory: passed to the torch profiler.
        enabled: when False, the block runs unprofiled and nothing is written (torch is
            not even imported).
        **profiler_kwargs: any other ``torch.profiler.profile`` argument (``with_flops``, ...).

    Raises:
        ValueError: an unknown activity name.
    """
    handle = ProfileHandle()
    if not enabled:
        yield handle
        return

    import torch

    output_dir = os.fspath(output_dir)
    name = filename or f"trace_rank{get_rank()}_pid{os.getpid()}_{time.time_ns()}.json"
    prof = torch.profiler.profile(
        activities=_activities(torch, activities),
        record_shapes=record_shapes,
        with_stack=with_stack,
        profile_memory=profile_memory,
        **profiler_kwargs,
    )
    handle.profiler = prof
    started = False
    try:
        with prof:
            started = True
            yield handle
    finally:
        # After the profiler stopped, so the trace is complete; also after a failure, to see it.
        if started:
            handle.trace_path = _export(prof, output_dir, name)


def _export(prof: Any, output_dir: str, name: str) -> str:
    from trellis.utils import fs

    if not fs.is_non_local(output_dir):
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, name)
        prof.export_chrome_trace(path)
        return path
    with tempfile.TemporaryDirectory(prefix="trellis-trace-") as staging:
        local = os.path.join(staging, name)
        prof.export_chrome_trace(local)
        return fs.copy(local, output_dir.rstrip("/") + "/" + name)


def _activities(torch: Any, activities: Iterable[Any] | None) -> list[Any]:
    kinds = torch.profiler.ProfilerActivity
    if activities is None:
        return [kinds.CPU, kinds.CUDA] if torch.cuda.is_available() else [kinds.CPU]
    chosen = []
    for activity in activities:
        if isinstance(activity, str):
            if activity.lower() not in ACTIVITY_NAMES:
                raise ValueError(
                    f"Unknown profiler activity {activity!r}; use one of {', '.join(ACTIVITY_NAMES)} "
                    "or a torch.profiler.ProfilerActivity."
                )
            activity = getattr(kinds, activity.upper())
        chosen.append(activity)
    return chosen

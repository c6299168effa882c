"""Wall-clock timers that add into a dict of timings, optionally marked in profiler traces."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``timings[name]`` (created at 0.0 if missing).

    Accumulates, so a timer entered several times in one step sums its runs. The time is
    added even when the block raises.
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - start)


@contextlib.contextmanager
def marked_timer(name: str, timings: dict[str, float], color: str | None = None) -> Iterator[None]:
    """:func:`timer`, plus a range named ``name`` in the profiler traces being recorded.

    When a torch profiler is recording, the block appears as a ``record_function`` range in
    its trace. When CUDA is initialised, the block is also an NVTX range (for Nsight Systems);
    ``color`` colours it when the ``nvtx`` package is installed, and is ignored otherwise.
    Outside a profiler this costs what :func:`timer` costs.
    """
    with timer(name, timings), _profiler_ranges(name, color):
        yield


def _profiler_ranges(name: str, color: str | None) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    torch = sys.modules.get("torch")
    if torch is None:  # a process that never imported torch has no torch profiler or CUDA context
        return stack
    if _profiler_running(torch):
        stack.enter_context(torch.profiler.record_function(name))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stack.enter_context(_nvtx_range(torch, name, color))
    return stack


def _profiler_running(torch: ModuleType) -> bool:
    """Whether a torch profiler records in this process: ``_profiler_enabled()`` sees one of the calling
    thread (or one it inherited); a profiler of every thread (``profile_all_threads``, as
    :func:`trellis.utils.profiling.start_profiler` starts) shows in the flag torch's profiler sets."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is None or enabled():
        return True
    return bool(getattr(getattr(torch.autograd, "profiler", None), "_is_profiler_enabled", False))


def _nvtx_range(torch: ModuleType, name: str, color: str | None) -> contextlib.AbstractContextManager[object]:
    try:
        import nvtx
    except ImportError:
        return torch.cuda.nvtx.range(name)
    return nvtx.annotate(message=name, color=color)

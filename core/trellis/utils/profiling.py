"""Profile code with the torch profiler: keep its Chrome trace and a table of its top operators.

:func:`profile` runs one block under the profiler. :func:`start_profiler` and :func:`write_profile`
serve profiles that span several calls (the trainer's ``trainer.profile`` stages, a Ray worker's share
of a stage): start, run, stop, then write ``<stem>.json`` (the trace) and ``<stem>.txt`` (the table).
"""

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


# ---------------------------------------------------------------- profiles spanning several calls


@dataclass
class ProfileReport:
    """What :func:`write_profile` wrote.

    Attributes:
        trace_path: the Chrome trace (``<stem>.json``; Perfetto, ``chrome://tracing``).
        table_path: the top-operator table (``<stem>.txt``).
        table: the table's text, as written.
    """

    trace_path: str
    table_path: str
    table: str


def start_profiler(
    *, activities: Iterable[Any] | None = None, record_shapes: bool = False, all_threads: bool = True
) -> Any:
    """A started ``torch.profiler.profile``; stop it with ``.stop()``, then :func:`write_profile`.

    Args:
        activities: as for :func:`profile` (default: CPU, plus CUDA when available).
        record_shapes: record each operator's input shapes (in the trace, and the table groups by them).
        all_threads: record the operators of every thread of the process, not only the calling one's:
            work handed to helper threads (the ``hf`` replica generates in one) shows too. A torch whose
            profiler lacks ``profile_all_threads`` records the calling thread's only.

    Raises:
        ValueError: an unknown activity name.
        RuntimeError: a torch profiler records in this process already (torch runs one at a time; a
            second one would crash the process).
    """
    import torch

    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        raise RuntimeError(
            f"A torch profiler is already recording in this process (pid {os.getpid()}); torch runs one "
            "at a time. Stop it first, or profile in one place only."
        )
    options: dict[str, Any] = {}
    if all_threads:
        config = _all_threads_config(torch)
        if config is not None:
            options["experimental_config"] = config
    prof = torch.profiler.profile(
        activities=_activities(torch, activities), record_shapes=record_shapes, **options
    )
    prof.start()
    return prof


def _all_threads_config(torch: Any) -> Any:
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # a torch without the option: the calling thread only
        return None


def write_profile(
    prof: Any, output_dir: str | os.PathLike[str], stem: str, *, top_k: int, title: str
) -> ProfileReport:
    """Write a stopped profiler's Chrome trace (``<output_dir>/<stem>.json``) and its top-operator table
    (``<stem>.txt``, headed by ``title``; see :func:`top_operators`). ``output_dir`` may be a URL
    (see :mod:`trellis.utils.fs`): both files are written locally first, then copied there."""
    from trellis.utils import fs

    output_dir = os.fspath(output_dir)
    table = f"{title}\n{top_operators(prof, top_k)}"
    if not fs.is_non_local(output_dir):
        os.makedirs(output_dir, exist_ok=True)
        return ProfileReport(
            trace_path=_export(prof, output_dir, f"{stem}.json"),
            table_path=_write_text(os.path.join(output_dir, f"{stem}.txt"), table),
            table=table,
        )
    with tempfile.TemporaryDirectory(prefix="trellis-trace-") as staging:
        local = _write_text(os.path.join(staging, f"{stem}.txt"), table)
        table_path = fs.copy(local, output_dir.rstrip("/") + f"/{stem}.txt")
    return ProfileReport(_export(prof, output_dir, f"{stem}.json"), table_path, table)


def _write_text(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return path


def top_operators(prof: Any, top_k: int) -> str:
    """The ``top_k`` operators of a stopped profiler by self CPU time, as torch's table (name, self and
    total CPU time, calls; input shapes, one row per shape, when it recorded them); when it recorded
    device activity, a second table by self device time (CUDA kernels, ...)."""
    averages = prof.key_averages(group_by_input_shape=bool(getattr(prof, "record_shapes", False)))
    tables = [f"By self CPU time:\n{averages.table(sort_by='self_cpu_time_total', row_limit=top_k)}"]
    # torch before the cuda -> device renaming of its profiler names the column self_cuda_time_total
    names = ("self_device_time_total", "self_cuda_time_total")
    device_key = next((name for name in names if averages and hasattr(averages[0], name)), None)
    if device_key and any(getattr(event, device_key, 0) > 0 for event in averages):
        tables.append(f"By self device time:\n{averages.table(sort_by=device_key, row_limit=top_k)}")
    return "\n".join(tables)


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

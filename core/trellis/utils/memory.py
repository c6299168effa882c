"""How much memory the device holds, and giving cached memory back.

On CUDA the numbers come from ``torch.cuda``'s caching allocator. On CPU there is no
allocator cache, so the nearest honest figures are used: *allocated* is the process's
resident set size (RSS), *reserved* its peak RSS, *total* the machine's physical memory.
torch is consulted only when the process has already imported it: a process that has not
has no CUDA memory to report.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import sys
from typing import Any

from trellis.utils.logging import get_rank

GIB = 2**30

_logger = logging.getLogger(__name__)


def device_memory_usage() -> dict[str, Any]:
    """Memory of this process's device, in GiB (2**30 bytes).

    Returns:
        ``{"device": "cuda:0" | "cpu", "allocated_gib": ..., "reserved_gib": ..., "total_gib": ...}``.
        On CPU: allocated = process RSS, reserved = peak RSS, total = physical memory.
    """
    torch = _cuda_torch()
    if torch is not None:
        index = torch.cuda.current_device()
        return {
            "device": f"cuda:{index}",
            "allocated_gib": torch.cuda.memory_allocated(index) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(index) / GIB,
            "total_gib": torch.cuda.get_device_properties(index).total_memory / GIB,
        }
    return {
        "device": "cpu",
        "allocated_gib": rss_bytes() / GIB,
        "reserved_gib": max(peak_rss_bytes(), rss_bytes()) / GIB,
        "total_gib": physical_memory_bytes() / GIB,
    }


def log_device_memory_usage(
    head: str, logger: logging.Logger | None = None, level: int = logging.DEBUG, rank: int = 0
) -> dict[str, Any] | None:
    """Log ``"<head>: <device> memory allocated X GiB, reserved Y GiB, total Z GiB"``, on rank ``rank`` only.

    ``logger`` defaults to this module's logger (``trellis.utils.memory``); at the default
    DEBUG level the line shows only when that logger is set to DEBUG, so calls can stay in
    the code. Returns the :func:`device_memory_usage` figures on the logging rank, None on the others.
    """
    if get_rank() != rank:
        return None
    usage = device_memory_usage()
    on_cpu = usage["device"] == "cpu"
    (logger or _logger).log(
        level,
        "%s: %s memory allocated %.2f GiB%s, reserved %.2f GiB%s, total %.2f GiB%s",
        head,
        usage["device"],
        usage["allocated_gib"],
        " (process RSS)" if on_cpu else "",
        usage["reserved_gib"],
        " (peak RSS)" if on_cpu else "",
        usage["total_gib"],
        " (physical)" if on_cpu else "",
    )
    return usage


def aggressive_empty_cache(force_sync: bool = True, max_retries: int = 3) -> dict[str, Any]:
    """Collect garbage and return the device's cached memory, repeating while it keeps helping.

    Each pass runs ``gc.collect()``; on CUDA it then empties the caching allocator
    (``torch.cuda.empty_cache()``, after ``synchronize()`` when ``force_sync``, so that memory
    of finished kernels can be released). Passes repeat, up to ``max_retries`` in all, while
    they make progress: on CUDA while reserved memory keeps dropping, on CPU while the
    collector keeps finding garbage (freeing objects can make more unreachable).

    Returns:
        ``{"device", "passes", "gc_collected", "reserved_before_gib", "reserved_after_gib",
        "freed_gib"}``; on CPU "reserved" is the process RSS, which the C allocator may keep
        even after objects are freed.

    Raises:
        ValueError: ``max_retries`` < 1.
    """
    if max_retries < 1:
        raise ValueError(f"max_retries must be at least 1, got {max_retries}.")
    torch = _cuda_torch(initialized_only=True)  # no CUDA context yet: nothing cached to give back

    def reserved() -> int:
        return torch.cuda.memory_reserved() if torch is not None else rss_bytes()

    start = before = reserved()
    collected = passes = 0
    while passes < max_retries:
        passes += 1
        found = gc.collect()
        collected += found
        if torch is not None:
            if force_sync:
                torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()
        after = reserved()
        progress = after < before if torch is not None else found > 0
        before = after
        if not progress:
            break
    return {
        "device": f"cuda:{torch.cuda.current_device()}" if torch is not None else "cpu",
        "passes": passes,
        "gc_collected": collected,
        "reserved_before_gib": start / GIB,
        "reserved_after_gib": before / GIB,
        "freed_gib": max(0, start - before) / GIB,
    }


def _cuda_torch(initialized_only: bool = False) -> Any | None:
    """torch, when this process imported it and CUDA is available (and initialised); else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    if initialized_only and not torch.cuda.is_initialized():
        return None
    return torch


def rss_bytes() -> int:
    """This process's resident set size, in bytes (its peak where there is no /proc)."""
    return _proc_status_bytes("VmRSS") or peak_rss_bytes()  # no /proc (macOS): the peak is all there is


def peak_rss_bytes() -> int:
    """This process's peak resident set size, in bytes."""
    peak = _proc_status_bytes("VmHWM")
    if peak:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def physical_memory_bytes() -> int:
    """The machine's physical memory, in bytes; 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0

"""The process's memory as the operating system reports it: resident set size, its peak, and the
machine's physical memory, in bytes; giving the free memory the C allocator (glibc's ``malloc``)
keeps in its heaps back to the OS; and how ``malloc`` treats freed memory (:func:`set_host_memory`).

These are the CPU's figures. A device's (allocated, reserved, total, on whichever backend is
selected) and giving its cached memory back are in :mod:`trellis.device.memory`, above this layer.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys
from typing import Any

GIB = 2**30
"""Bytes in a GiB."""

HOST_MEMORY_POLICIES = ("reuse", "release")
"""The names :func:`set_host_memory` takes (``trainer.host_memory``)."""

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8
_INT_MAX = 2**31 - 1  # mallopt takes an int
_policy = "release"  # glibc's own behaviour until set_host_memory says otherwise


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


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; True when it was reset.

    Linux only (``/proc/self/clear_refs``); elsewhere nothing changes and the answer is False.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (proc(5))
    except OSError:
        return False
    return True


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


@functools.cache
def _glibc() -> Any:
    """The C library as a ctypes handle when it is glibc (it has ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):  # no glibc (macOS, musl): no such functions
        return None
    return libc


def trim_malloc_heaps() -> bool:
    """Give the free memory glibc's ``malloc`` keeps in its heaps back to the OS; True when it ran.

    ``malloc_trim(0)``: every arena's free pages are released (``madvise``), not only the top of the
    main heap, so the resident set drops to what is still allocated. Costs a walk over the free
    chunks (about 70 ms for 512 MiB in 8192 holes, measured on 2 cores) and page faults when those
    pages are used again. Without glibc nothing happens and the answer is False.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def host_memory() -> str:
    """This process's policy for freed CPU memory: ``reuse`` or ``release`` (see :func:`set_host_memory`)."""
    return _policy


def set_host_memory(policy: str) -> str:
    """Set how this process's ``malloc`` treats memory torch frees; returns the policy before.

    - ``reuse``: freed memory stays with the process and serves the next request. One malloc arena
      for every thread (``M_ARENA_MAX=1``: what a training stage frees in one thread, generation in
      another thread reuses), no blocks of their own from ``mmap`` however large (``M_MMAP_MAX=0``:
      such blocks go back to the OS when freed and every page of the next one is faulted in and
      zeroed again), no automatic trimming of the heap's top (``M_TRIM_THRESHOLD`` at its maximum).
      Engines leave the heaps alone between phases (:meth:`trellis.engine.base.TrainingEngine.phase`).
      The resident set stays at the run's high-water mark; no page is faulted in twice.
    - ``release``: glibc's behaviour (large blocks from ``mmap``, trimming), and engines on a CPU
      device give malloc's free heap memory back to the OS when a phase starts and ends
      (:func:`trim_malloc_heaps`). The resident set drops between phases; the next phase faults
      its pages in again. Switching back from ``reuse`` sets glibc's steady-state values (a fixed
      32 MiB mmap threshold, 64 MiB trim threshold, 65536 mmaps): ``mallopt`` cannot restore the
      dynamic thresholds. The arena limit stays: glibc fixes it once it has been used.

    On the demo's update (SmolLM2, 2 cores) ``release`` faulted in 1.8 million pages a step and
    spent 10-20 s of system time on them; ``reuse`` none (docs/performance.md, "Memory"). Threads that
    already allocated keep their arena, so call this before starting worker threads. Without glibc
    only the recorded policy changes (and with it what engines do between phases).

    Raises:
        ValueError: ``policy`` is not one of :data:`HOST_MEMORY_POLICIES`.
    """
    global _policy
    if policy not in HOST_MEMORY_POLICIES:
        raise ValueError(
            f"trainer.host_memory must be one of {', '.join(HOST_MEMORY_POLICIES)}, got {policy!r}: reuse "
            "keeps freed memory for the next stage (fastest), release gives it back to the OS between phases."
        )
    before, _policy = _policy, policy
    libc = _glibc()
    if libc is None or policy == before:
        return before
    if policy == "reuse":
        settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX))
    else:
        settings = ((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, 32 * 2**20), (_M_TRIM_THRESHOLD, 64 * 2**20))
    for param, value in settings:
        libc.mallopt(param, value)
    return before

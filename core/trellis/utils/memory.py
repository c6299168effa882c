"""The process's memory as the operating system reports it: resident set size, its peak, and the
machine's physical memory, in bytes; and giving the free memory the C allocator (glibc's ``malloc``)
keeps in its heaps back to the OS.

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

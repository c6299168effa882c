"""trellis.utils.memory: the process's RSS, its peak (and resetting it), and physical memory."""

from __future__ import annotations

import pytest

from trellis.utils.memory import GIB, peak_rss_bytes, physical_memory_bytes, reset_peak_rss, rss_bytes

MIB = 2**20


def proc_kib(path, field):
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_rss_peak_and_physical_memory_are_the_kernels_figures():
    assert abs(rss_bytes() - proc_kib("/proc/self/status", "VmRSS") * 1024) < 50 * MIB
    assert peak_rss_bytes() >= proc_kib("/proc/self/status", "VmHWM") * 1024 >= rss_bytes() - 50 * MIB
    assert physical_memory_bytes() == proc_kib("/proc/meminfo", "MemTotal") * 1024
    assert 0.01 * GIB < rss_bytes() < physical_memory_bytes()


def test_reset_peak_rss_forgets_an_earlier_peak():
    spike = b"\x01" * (256 * MIB)  # written, so resident
    del spike
    before = peak_rss_bytes()
    assert before > rss_bytes() + 200 * MIB
    assert reset_peak_rss() is True
    assert peak_rss_bytes() < before - 200 * MIB
    assert peak_rss_bytes() == pytest.approx(rss_bytes(), abs=50 * MIB)


def test_trim_malloc_heaps_gives_freed_heap_memory_back(python):
    done = python(
        "import ctypes\n"
        "from trellis.utils.memory import rss_bytes, trim_malloc_heaps\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "blocks = [libc.malloc(65536) for _ in range(4096)]  # 256 MiB from the heap\n"
        "for block in blocks:\n"
        "    ctypes.memset(block, 1, 65536)\n"
        "for block in blocks[:-1:2]:  # every other one: holes that free() alone keeps resident\n"
        "    libc.free(block)\n"
        "held = rss_bytes()\n"
        "print(trim_malloc_heaps(), round((held - rss_bytes()) / 2**20))\n"
    )
    assert done.returncode == 0, done.stderr
    ran, freed_mib = done.stdout.split()
    if ran == "False":  # no glibc: nothing to give back
        assert int(freed_mib) < 16
    else:
        assert 100 < int(freed_mib) <= 140  # the 128 MiB of holes, not the blocks still in use

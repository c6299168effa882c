"""trellis.utils.memory: the process's RSS, its peak (and resetting it), physical memory, and malloc's
policy for freed memory."""

from __future__ import annotations

import pytest

from trellis.utils.memory import (
    GIB,
    host_memory,
    peak_rss_bytes,
    physical_memory_bytes,
    reset_peak_rss,
    rss_bytes,
    set_host_memory,
)

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


# A fresh interpreter allocates a 128 MiB tensor (written, so resident), frees it, and allocates a 64 MiB
# one, under each policy in turn: the MiB still resident after the free, and the pages the second
# allocation faulted in. (Smaller, so that it fits in the freed block whatever was allocated after it;
# both above the 32 MiB that glibc's dynamic mmap threshold can reach, so its default mmaps them.)
FREED_AND_AGAIN = """
import resource, torch
from trellis.utils.memory import host_memory, rss_bytes, set_host_memory, trim_malloc_heaps
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def cycle():
    block = torch.ones(32 * 2**20)
    before_free = rss_bytes()
    del block
    held = rss_bytes() - (before_free - 128 * 2**20)  # what stays resident of the freed 128 MiB
    start = faults()
    block = torch.ones(16 * 2**20)
    again = faults() - start
    del block
    return round(held / 2**20), again
print(host_memory(), *cycle())
print(set_host_memory("reuse"), host_memory(), *cycle())
previous = set_host_memory("release")
trim_malloc_heaps()  # as engines do between phases under release
print(previous, host_memory(), *cycle())
"""


def test_reuse_keeps_freed_memory_for_the_next_allocation_and_release_gives_it_back(python):
    done = python(FREED_AND_AGAIN)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[:-2] for line in lines] == [["release"], ["release", "reuse"], ["reuse", "release"]]
    pages = 64 * 2**20 // 4096  # the second tensor's 16384 pages of 4 KiB
    (held, again), (reuse_held, reuse_again), (release_held, release_again) = (
        (int(a), int(b)) for *_, a, b in lines
    )
    # glibc's default: a large block is an mmap of its own, unmapped on free, the next one faulted in afresh
    assert held < 8 and again > pages * 0.9
    # reuse: it stays in the heap, resident, and the next tensor takes the same pages without a fault
    assert reuse_held > 120 and reuse_again < pages * 0.05
    # release after reuse (what reuse kept given back, as engines do between phases): faulted in again
    assert release_held < 8 and release_again > pages * 0.9


def test_set_host_memory_returns_the_policy_before_and_refuses_unknown_names():
    before = host_memory()
    assert set_host_memory("reuse") == before
    assert set_host_memory("release") == "reuse"
    with pytest.raises(ValueError, match=r"trainer.host_memory must be one of reuse, release, got 'keep'"):
        set_host_memory("keep")
    assert host_memory() == "release"

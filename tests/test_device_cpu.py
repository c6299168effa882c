"""trellis.device.cpu: the always-available backend, measured for real."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from trellis.device import DeviceError
from trellis.device.cpu import (
    CPUBackend,
    CPUEvent,
    CPUStream,
    CPUTorchModule,
    flushes_denormal,
    native_bf16,
    set_flush_denormal,
)
from trellis.utils.memory import trim_malloc_heaps


def proc_kib(path, field):
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_attributes():
    backend = CPUBackend()
    assert (backend.name, backend.priority, backend.device_type) == ("cpu", 0, "cpu")
    assert (backend.communication_backend, backend.visible_devices_env, backend.ray_resource) == (
        "gloo",
        None,
        None,
    )
    assert backend.is_available() is True and backend.unavailable_reason() is None
    assert repr(backend) == "<CPUBackend 'cpu'>"


def test_one_device_that_every_local_rank_may_set():
    backend = CPUBackend()
    assert (backend.device_count(), backend.current_device()) == (1, 0)
    backend.set_device(0)
    backend.set_device(3)  # local rank 3 of a 4-process gloo group: all share the host
    assert backend.current_device() == 0
    with pytest.raises(DeviceError, match=r"Device index must be >= 0 \(e\.g\. the local rank\), got -1\."):
        backend.set_device(-1)
    with pytest.raises(
        TypeError, match=r"Device index must be an int \(e\.g\. the local rank\), got '0' of type str"
    ):
        backend.set_device("0")
    with pytest.raises(TypeError, match="got True of type bool"):
        backend.set_device(True)


def test_memory_is_rss_peak_rss_and_physical_memory_in_bytes():
    backend = CPUBackend()
    allocated, reserved, total = backend.memory_allocated(), backend.memory_reserved(), backend.total_memory()
    assert all(isinstance(v, int) for v in (allocated, reserved, total))
    assert abs(allocated - proc_kib("/proc/self/status", "VmRSS") * 1024) < 50 * 2**20
    assert reserved >= allocated
    assert reserved >= proc_kib("/proc/self/status", "VmHWM") * 1024 - 50 * 2**20
    assert total == proc_kib("/proc/meminfo", "MemTotal") * 1024
    assert backend.total_memory(0) == total and backend.memory_allocated(0) > 0
    with pytest.raises(DeviceError, match="got -2"):
        backend.memory_reserved(-2)
    assert backend.empty_cache() is None and backend.synchronize() is None


def test_events_measure_a_sleep_in_milliseconds():
    backend = CPUBackend()
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    assert isinstance(start, CPUEvent) and start.query() is True  # nothing pending, even unrecorded
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float)
    assert 20 <= elapsed < 1000
    assert end.elapsed_time(start) == pytest.approx(-elapsed)  # the truth, even backwards
    again = backend.Event(enable_timing=True)
    again.record(backend.current_stream())  # an explicit stream is accepted
    assert start.elapsed_time(again) >= elapsed


def test_elapsed_time_before_record_says_what_to_do():
    backend = CPUBackend()
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    with pytest.raises(DeviceError) as caught:
        start.elapsed_time(end)
    assert str(caught.value) == (
        "elapsed_time(): the start event has not been recorded yet. Call start.record() before the work "
        "to time and end.record() after it, then start.elapsed_time(end)."
    )
    start.record()
    with pytest.raises(DeviceError, match=r"^elapsed_time\(\): the end event has not been recorded yet\."):
        start.elapsed_time(end)


def test_elapsed_time_needs_timing_events_of_one_backend():
    backend = CPUBackend()
    timed, untimed = backend.Event(enable_timing=True), backend.Event()
    timed.record()
    untimed.record()
    with pytest.raises(DeviceError) as caught:
        timed.elapsed_time(untimed)
    assert str(caught.value) == (
        "elapsed_time(): the end event was made with enable_timing=False. "
        "Make both events with backend.Event(enable_timing=True)."
    )
    with pytest.raises(DeviceError, match=r"needs an end event of the same backend \(CPUEvent\); got int"):
        timed.elapsed_time(3)


def test_streams_are_sequential_and_nest_per_thread():
    backend = CPUBackend()
    default = backend.current_stream()
    assert isinstance(default, CPUStream) and backend.current_stream() is default
    outer, inner = backend.Stream(), backend.Stream()
    event = backend.Event()
    event.record()
    outer.wait_event(event)  # no-ops: CPU work before them has already run
    outer.wait_stream(default)
    seen_elsewhere = []
    with backend.stream(outer):
        assert backend.current_stream() is outer
        with backend.stream(inner):
            assert backend.current_stream() is inner
            thread = threading.Thread(target=lambda: seen_elsewhere.append(backend.current_stream()))
            thread.start()
            thread.join()
        assert backend.current_stream() is outer
        with backend.stream(None):
            assert backend.current_stream() is outer
    assert backend.current_stream() is default
    assert seen_elsewhere == [default]  # another thread keeps its own current stream
    assert outer.query() is True and outer.synchronize() is None


def test_streams_refuse_foreign_objects():
    backend = CPUBackend()
    with pytest.raises(
        TypeError, match=r"CPUBackend.stream\(\) needs a stream from the cpu backend's Stream\(\)"
    ):
        backend.stream("side")
    with pytest.raises(
        TypeError, match=r"CPUStream.wait_event\(\) needs an event from the cpu backend's Event\(\)"
    ):
        backend.Stream().wait_event(object())
    with pytest.raises(TypeError, match=r"CPUStream.wait_stream\(\) needs a stream"):
        backend.Stream().wait_stream(None)
    with pytest.raises(TypeError, match=r"CPUEvent.record\(\) needs a stream"):
        backend.Event().record("default")


def test_torch_module_answers_torch_cuda_calls_for_the_cpu():
    backend = CPUBackend()
    module = backend.torch_module
    assert isinstance(module, CPUTorchModule) and backend.torch_module is module
    assert module.is_available() and (module.device_count(), module.current_device()) == (1, 0)
    module.set_device(0)
    module.synchronize()
    module.empty_cache()
    assert module.memory_allocated() > 0 and module.max_memory_allocated() >= module.memory_allocated()
    assert module.memory_reserved() <= module.max_memory_reserved() + 50 * 2**20
    module.manual_seed(7)
    first = torch.rand(3)
    state = module.get_rng_state()
    second = torch.rand(3)
    module.manual_seed_all(7)
    assert torch.equal(torch.rand(3), first)
    module.set_rng_state(state)
    assert torch.equal(torch.rand(3), second)
    assert module.Stream is torch.cpu.Stream  # the rest is torch.cpu
    with pytest.raises(
        AttributeError, match=r"Neither the cpu backend's torch namespace nor torch.cpu has 'nothing'"
    ):
        module.nothing  # noqa: B018


def test_the_cpu_backend_does_not_import_torch(python):
    done = python(
        "import sys, time\n"
        "from trellis.device.cpu import CPUBackend\n"
        "b = CPUBackend()\n"
        "b.set_device(0); b.synchronize(); b.empty_cache()\n"
        "s, e = b.Event(enable_timing=True), b.Event(enable_timing=True)\n"
        "s.record(); e.record()\n"
        "with b.stream(b.Stream()):\n"
        "    b.current_stream().wait_event(e)\n"
        "print(s.elapsed_time(e) >= 0, b.memory_allocated() > 0, b.total_memory() > 0,\n"
        "      'torch' in sys.modules)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True True True False"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n", False),  # AVX-512 without BF16
        ("flags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n", True),
        ("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n", True),
        ("Features\t: fp asimd sve bf16 i8mm\n", True),  # Arm
        ("Features\t: fp asimd\n", False),
        ("", False),
    ],
)
def test_native_bf16_reads_the_cpus_flags(cpuinfo, native):
    assert native_bf16(cpuinfo) is native


GLIBC_TRIM = """
import ctypes, sys
from trellis.device.cpu import CPUBackend
from trellis.utils.memory import rss_bytes

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 1024  # under malloc's mmap threshold: served from its heap
blocks = [libc.malloc(size) for _ in range(4096)]  # 256 MiB
for block in blocks:
    ctypes.memset(block, 1, size)  # touched, so resident
for block in blocks[:-1]:  # the last one pins the heap's top: free() alone cannot shrink it
    libc.free(block)
held = rss_bytes()
CPUBackend().empty_cache()
print(round((held - rss_bytes()) / 2**20))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux) to read the RSS")
def test_empty_cache_gives_mallocs_free_heap_memory_back_to_the_os(python):
    done = python(GLIBC_TRIM)
    assert done.returncode == 0, done.stderr
    if not trim_malloc_heaps():
        assert int(done.stdout) < 16  # no glibc: nothing to trim, nothing changes
        return
    assert int(done.stdout) > 200  # of the 256 MiB freed into the heap, in MiB


def test_set_flush_denormal_flushes_on_this_thread_and_the_threads_it_starts_later():
    before = set_flush_denormal(False)
    try:
        assert flushes_denormal() is False
        assert torch.tensor([1e-39]).mul(1.0).item() == pytest.approx(1e-39, rel=1e-3)  # gradual underflow
        assert set_flush_denormal(True) is False  # the setting before
        assert flushes_denormal() is True
        assert torch.tensor([1e-39]).mul(1.0).item() == 0.0
        assert set_flush_denormal(True) is True
        started_after: list[bool] = []
        thread = threading.Thread(target=lambda: started_after.append(flushes_denormal()))
        thread.start()
        thread.join()
        assert started_after == [True]
    finally:
        set_flush_denormal(before)

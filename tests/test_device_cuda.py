"""trellis.device.cuda (and the accelerator base under it): unavailable here, and on a faked torch.cuda."""

from __future__ import annotations

import time

import pytest
import torch

from trellis.device import DeviceError, DeviceUnavailableError
from trellis.device.accelerator import AcceleratorEvent, AcceleratorStream
from trellis.device.cpu import CPUBackend
from trellis.device.cuda import CUDABackend
from trellis.testing.device import FakeAccelerator

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as a two-device accelerator (see trellis.testing.device.FakeAccelerator)."""
    fake = FakeAccelerator(device_count=2, total=80 * 2**30, name="Fake H100")
    fake.patch(monkeypatch, torch.cuda)
    return fake


def test_attributes():
    backend = CUDABackend()
    assert (backend.name, backend.priority, backend.device_type) == ("cuda", 10, "cuda")
    assert (backend.communication_backend, backend.visible_devices_env, backend.ray_resource) == (
        "nccl",
        "CUDA_VISIBLE_DEVICES",
        "GPU",
    )


@needs_no_cuda
def test_unavailable_here_with_the_reason():
    backend = CUDABackend()
    assert backend.is_available() is False
    reason = backend.unavailable_reason()
    assert reason.startswith("torch.cuda.is_available() is False: no CUDA driver or device")
    if torch.version.cuda is None and torch.version.hip is None:
        assert reason.endswith(
            f"(this torch build, {torch.__version__}, has no CUDA support; install a CUDA build)"
        )
    assert backend.device_count() == 0
    expected = f"Device backend 'cuda' is not available: {reason}. Run 'trellis doctor'"
    for call in (backend.current_device, backend.synchronize, backend.Event, lambda: backend.torch_module):
        with pytest.raises(DeviceUnavailableError) as caught:
            call()
        assert str(caught.value).startswith(expected)


def test_reason_on_a_cuda_build_without_a_device_names_the_mask(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CUDABackend().unavailable_reason() == (
        "torch.cuda.is_available() is False: no CUDA driver or device (CUDA_VISIBLE_DEVICES='')"
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert (
        CUDABackend().unavailable_reason() == "torch.cuda.is_available() is False: no CUDA driver or device"
    )


def test_a_failing_driver_check_is_a_reason_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    backend = CUDABackend()
    assert backend.is_available() is False
    assert backend.unavailable_reason() == (
        "torch.cuda.is_available() raised RuntimeError: CUDA driver version is insufficient"
    )


def test_devices_and_memory_on_fake_cuda(fake_cuda):
    backend = CUDABackend()
    assert backend.is_available() and backend.unavailable_reason() is None
    assert backend.torch_module is torch.cuda
    assert (backend.device_count(), backend.current_device()) == (2, 0)
    backend.set_device(1)
    assert backend.current_device() == 1 and fake_cuda.current_device() == 1
    assert backend.memory_allocated() == 3 * 2**20 and backend.memory_reserved() == 4 * 2**20
    assert backend.total_memory() == 80 * 2**30 and backend.total_memory(0) == 80 * 2**30
    with pytest.raises(DeviceError) as caught:
        backend.set_device(2)
    assert str(caught.value) == (
        "Device index 2 is out of range: backend 'cuda' sees 2 devices (indices 0..1). "
        "Check CUDA_VISIBLE_DEVICES (it decides which devices this process sees)."
    )
    with pytest.raises(DeviceError, match="Device index 5 is out of range"):
        backend.memory_allocated(5)
    with pytest.raises(TypeError, match="Device index must be an int"):
        backend.set_device(1.0)
    backend.empty_cache()
    backend.synchronize()
    assert fake_cuda.calls == {"set_device": 1, "empty_cache": 1, "synchronize": 1}


def test_events_wrap_the_native_ones_on_fake_cuda(fake_cuda):
    backend = CUDABackend()
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    assert isinstance(start, AcceleratorEvent) and isinstance(start.native, fake_cuda.Event)
    assert start.native.enable_timing is True
    side = backend.Stream()
    start.record()
    time.sleep(0.02)
    end.record(side)
    assert start.native.stream is fake_cuda.current_stream() and end.native.stream is side.native
    assert 20 <= start.elapsed_time(end) < 1000
    assert end.query() is True
    with pytest.raises(DeviceError, match="the end event has not been recorded yet"):
        start.elapsed_time(backend.Event(enable_timing=True))
    with pytest.raises(DeviceError, match="needs an end event of the same backend"):
        start.elapsed_time(CPUBackend().Event(enable_timing=True))


def test_streams_wrap_the_native_ones_on_fake_cuda(fake_cuda):
    backend = CUDABackend()
    default = backend.current_stream()
    assert isinstance(default, AcceleratorStream) and default == backend.current_stream()
    side = backend.Stream()
    assert side != default and len({side, default, backend.current_stream()}) == 2
    ready = backend.Event()
    ready.record()
    side.wait_event(ready)
    side.wait_stream(default)
    assert side.native.waited_on == [ready.native, default.native]
    with backend.stream(side):
        assert backend.current_stream() == side
    assert backend.current_stream() == default
    with pytest.raises(
        TypeError, match=r"CUDABackend.stream\(\) needs a stream from this backend's Stream\(\)"
    ):
        backend.stream(CPUBackend().Stream())
    with pytest.raises(
        TypeError, match=r"Stream.wait_event\(\) needs an event from this backend's Event\(\), got a CPUEvent"
    ):
        side.wait_event(CPUBackend().Event())
    with pytest.raises(TypeError, match=r"Stream.wait_stream\(\) needs a stream, got None"):
        side.wait_stream(None)

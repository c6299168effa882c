"""trellis.device.memory: device memory figures and emptying caches, through the selected backend.

A fake NPU-like backend, selected with ``TRELLIS_DEVICE`` as a plugin's would be, must report its
own numbers and receive the synchronize/empty_cache calls; the cpu backend gives the CPU's figures.
Also the backends' peak figures (``max_memory_allocated``, ``reset_peak_memory_stats``) and the
trainer's ``perf/max_memory_allocated_gib``, which reads them.
"""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest

import trellis.device.memory as device_memory
from trellis.device import DeviceBackend, clear_device_backend_cache, get_device_backend
from trellis.device.accelerator import TorchAcceleratorBackend
from trellis.device.cpu import CPUBackend
from trellis.device.memory import aggressive_empty_cache, device_memory_usage, log_device_memory_usage
from trellis.registries import device_backends
from trellis.utils.memory import GIB, peak_rss_bytes, physical_memory_bytes, rss_bytes

MIB = 2**20


class FakeNPU(DeviceBackend):
    """A backend of two devices (the current one is 1) that answers from attributes and logs calls.

    ``empty_cache`` gives back 1 GiB of the reserved 8 GiB each time, down to 6 GiB.
    """

    name = "zz_fake_npu"
    device_type = "npu"
    communication_backend = "hccl"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.asked: set[int | None] = set()
        self.reserved = 8 * GIB
        self.started = True
        self.namespace = SimpleNamespace(
            is_initialized=lambda: self.started, ipc_collect=lambda: self.calls.append("ipc_collect")
        )

    def unavailable_reason(self) -> str | None:
        return None

    @property
    def torch_module(self) -> SimpleNamespace:
        return self.namespace

    def current_device(self) -> int:
        return 1

    def _ask(self, device: int | None, value: int) -> int:
        self.asked.add(device)
        return value

    def memory_allocated(self, device: int | None = None) -> int:
        return self._ask(device, 3 * GIB)

    def memory_reserved(self, device: int | None = None) -> int:
        return self._ask(device, self.reserved)

    def max_memory_allocated(self, device: int | None = None) -> int:
        return self._ask(device, 5 * GIB)

    def total_memory(self, device: int | None = None) -> int:
        return self._ask(device, 64 * GIB)

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = max(6 * GIB, self.reserved - GIB)


@pytest.fixture
def select(monkeypatch):
    """select(name, cls=None): register ``cls`` as ``name`` (if given), select it with TRELLIS_DEVICE;
    returns the process's backend instance."""
    added = []

    def choose(name, cls=None):
        if cls is not None:
            device_backends.register(name, cls)
            added.append(name)
        monkeypatch.setenv("TRELLIS_DEVICE", name)
        clear_device_backend_cache()
        return get_device_backend()

    yield choose
    for name in added:
        device_backends.unregister(name)
    clear_device_backend_cache()


@pytest.fixture
def fake_npu(select):
    return select(FakeNPU.name, FakeNPU)


def test_device_memory_usage_reports_the_selected_backend(fake_npu):
    assert device_memory_usage() == {
        "device": "npu:1",
        "allocated_gib": 3.0,
        "reserved_gib": 8.0,
        "max_allocated_gib": 5.0,
        "total_gib": 64.0,
    }
    assert fake_npu.asked == {1}  # every figure of the current device, by its index


def test_log_device_memory_usage_names_the_backends_device(fake_npu, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.DEBUG, logger="trellis.device.memory"):
        assert log_device_memory_usage("after rollout")["device"] == "npu:1"
        assert log_device_memory_usage("elsewhere", rank=1) is None
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "trellis.device.memory",
            logging.DEBUG,
            "after rollout: npu:1 memory allocated 3.00 GiB, reserved 8.00 GiB, total 64.00 GiB",
        )
    ]


def test_aggressive_empty_cache_empties_the_backend_while_it_helps(fake_npu, monkeypatch):
    monkeypatch.setattr(device_memory.gc, "collect", lambda: 0)  # progress only from the device
    result = aggressive_empty_cache(max_retries=5)
    # 8 -> 7 -> 6 GiB, then a pass that frees nothing ends it
    assert fake_npu.calls == ["synchronize", "empty_cache", "ipc_collect"] * 3
    assert result == {
        "device": "npu:1",
        "passes": 3,
        "gc_collected": 0,
        "reserved_before_gib": 8.0,
        "reserved_after_gib": 6.0,
        "freed_gib": 2.0,
    }


def test_aggressive_empty_cache_without_sync_and_before_the_runtime_starts(fake_npu):
    aggressive_empty_cache(force_sync=False, max_retries=1)
    assert fake_npu.calls == ["empty_cache", "ipc_collect"]

    fake_npu.calls.clear()
    fake_npu.asked.clear()
    fake_npu.started = False  # e.g. torch.cuda.is_initialized() False: asking would start it
    result = aggressive_empty_cache()
    assert fake_npu.calls == [] and fake_npu.asked == set()
    assert (result["device"], result["reserved_before_gib"], result["freed_gib"]) == ("npu", 0.0, 0.0)


def test_cpu_memory_usage_is_rss_peak_and_physical(select):
    select("cpu")
    usage = device_memory_usage()
    assert usage["device"] == "cpu"
    assert abs(usage["allocated_gib"] - rss_bytes() / GIB) < 50 * MIB / GIB
    assert usage["allocated_gib"] <= usage["reserved_gib"] + 1e-6  # the peak is never below now
    assert abs(usage["reserved_gib"] - peak_rss_bytes() / GIB) < 50 * MIB / GIB
    assert usage["max_allocated_gib"] == pytest.approx(usage["reserved_gib"], abs=50 * MIB / GIB)
    assert usage["total_gib"] == physical_memory_bytes() / GIB
    assert 0.01 < usage["allocated_gib"] < usage["total_gib"]


def test_log_device_memory_usage_on_cpu_says_what_the_figures_are(select, caplog, monkeypatch):
    select("cpu")
    logger = logging.getLogger("trellis.test_device_memory")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.DEBUG):
        usage = log_device_memory_usage("rank 1", logger=logger, level=logging.INFO, rank=1)
    [record] = caplog.records
    assert (record.name, record.levelno) == ("trellis.test_device_memory", logging.INFO)
    message = record.getMessage()
    assert message.startswith("rank 1: cpu memory allocated ")
    assert " GiB (process RSS), reserved " in message and " GiB (peak RSS), total " in message
    assert message.endswith(f"total {usage['total_gib']:.2f} GiB (physical)")


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cycle collector frees it


def test_aggressive_empty_cache_on_cpu_collects_cycles(select):
    select("cpu")
    was_enabled = gc.isenabled()
    gc.disable()  # keep the automatic collector from freeing the cycles first
    try:
        gc.collect()
        nodes = [Node() for _ in range(500)]
        del nodes
        result = aggressive_empty_cache()
    finally:
        if was_enabled:
            gc.enable()
    assert result["device"] == "cpu"
    assert result["gc_collected"] >= 500  # every Node (and, on older Pythons, its __dict__)
    assert 2 <= result["passes"] <= 3  # a second pass finds nothing left, and stops
    assert result["freed_gib"] == max(0.0, result["reserved_before_gib"] - result["reserved_after_gib"])
    assert set(result) == {
        "device",
        "passes",
        "gc_collected",
        "reserved_before_gib",
        "reserved_after_gib",
        "freed_gib",
    }


def test_aggressive_empty_cache_stops_after_max_retries(select):
    select("cpu")
    assert aggressive_empty_cache(max_retries=1)["passes"] == 1
    with pytest.raises(ValueError, match=r"max_retries must be at least 1, got 0\."):
        aggressive_empty_cache(max_retries=0)


# ---------------------------------------------------------------- peak figures of the backends


def test_cpu_peak_is_the_peak_rss_and_resets():
    backend = CPUBackend()
    spike = b"\x01" * (256 * MIB)  # written, so resident
    del spike
    peak = backend.max_memory_allocated()
    assert peak == backend.memory_reserved() >= backend.memory_allocated() + 200 * MIB
    backend.reset_peak_memory_stats()
    assert backend.max_memory_allocated() < peak - 200 * MIB
    assert backend.torch_module.max_memory_allocated() == pytest.approx(
        backend.max_memory_allocated(), abs=50 * MIB
    )


class Namespace(TorchAcceleratorBackend):
    """A torch.cuda-shaped backend over a namespace that logs the peak calls."""

    name, device_type, communication_backend = "zz_namespace", "zz", "gloo"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.namespace = SimpleNamespace(
            device_count=lambda: 2,
            current_device=lambda: 1,
            max_memory_allocated=lambda index: self.calls.append(("max", index)) or 7 * GIB,
            reset_peak_memory_stats=lambda index: self.calls.append(("reset", index)),
        )

    def unavailable_reason(self) -> str | None:
        return None

    def _load_torch_module(self) -> SimpleNamespace:
        return self.namespace


def test_accelerator_peak_is_the_namespaces():
    backend = Namespace()
    assert backend.max_memory_allocated() == 7 * GIB
    assert backend.max_memory_allocated(0) == 7 * GIB
    backend.reset_peak_memory_stats()
    assert backend.calls == [("max", 1), ("max", 0), ("reset", 1)]


def test_trainer_peak_memory_metric_is_the_backends_max_allocated(fake_npu):
    from trellis.trainer.metrics import peak_memory_metrics

    assert peak_memory_metrics() == {"perf/max_memory_allocated_gib": 5.0}

"""trellis.utils.memory: device memory figures (CPU figures here) and emptying caches."""

from __future__ import annotations

import gc
import logging

import pytest

from trellis.utils.memory import aggressive_empty_cache, device_memory_usage, log_device_memory_usage


def proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_cpu_memory_usage_is_rss_peak_and_physical():
    usage = device_memory_usage()
    assert usage["device"] == "cpu"
    rss = proc_status_kib("VmRSS") / 2**20
    assert abs(usage["allocated_gib"] - rss) < 0.05  # within 50 MiB of /proc's own figure
    assert usage["allocated_gib"] <= usage["reserved_gib"] + 1e-6  # the peak is never below now
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])
    assert usage["total_gib"] == pytest.approx(total_kib / 2**20)
    assert 0.01 < usage["allocated_gib"] < usage["total_gib"]


def test_log_device_memory_usage_on_its_rank_only(caplog, monkeypatch):
    logger = logging.getLogger("trellis.test_utils_memory")
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.DEBUG):
        usage = log_device_memory_usage("after rollout", logger=logger)
        assert log_device_memory_usage("elsewhere", logger=logger, rank=1) is None
        log_device_memory_usage("default logger", level=logging.INFO)
    assert [r.name for r in caplog.records] == ["trellis.test_utils_memory", "trellis.utils.memory"]
    message = caplog.records[0].getMessage()
    assert message.startswith("after rollout: cpu memory allocated ")
    assert " GiB (process RSS), reserved " in message and " GiB (peak RSS), total " in message
    assert message.endswith(f"total {usage['total_gib']:.2f} GiB (physical)")
    assert caplog.records[0].levelno == logging.DEBUG

    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        assert log_device_memory_usage("rank 1", logger=logger, rank=1)["device"] == "cpu"
    assert caplog.records[0].getMessage().startswith("rank 1: cpu memory")


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cycle collector frees it


def test_aggressive_empty_cache_on_cpu_collects_cycles():
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


def test_aggressive_empty_cache_stops_after_max_retries():
    assert aggressive_empty_cache(max_retries=1)["passes"] == 1
    with pytest.raises(ValueError, match=r"max_retries must be at least 1, got 0\."):
        aggressive_empty_cache(max_retries=0)

"""trellis.utils.timing: timers that add into a dict, and their ranges in profiler traces."""

from __future__ import annotations

import json
import time

import pytest
import torch

from trellis.utils.timing import marked_timer, timer


def test_timer_adds_seconds_and_accumulates():
    timings = {}
    with timer("gen", timings):
        time.sleep(0.05)
    assert 0.05 <= timings["gen"] < 1.0
    first = timings["gen"]
    with timer("gen", timings):
        time.sleep(0.05)
    assert first + 0.05 <= timings["gen"] < first + 1.0
    with timer("update", timings):
        pass
    assert list(timings) == ["gen", "update"] and 0.0 <= timings["update"] < 0.05


def test_timer_counts_a_block_that_raised():
    timings = {"gen": 1.0}
    with pytest.raises(KeyError), timer("gen", timings):
        time.sleep(0.05)
        raise KeyError("boom")
    assert 1.05 <= timings["gen"] < 2.0


def test_marked_timer_times_like_timer():
    timings = {}
    with marked_timer("reward", timings, color="green"):
        time.sleep(0.05)
    assert 0.05 <= timings["reward"] < 1.0


def test_marked_timer_range_appears_in_a_torch_profiler_trace(tmp_path):
    timings = {}
    x = torch.randn(16, 16)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, marked_timer("rollout_step", timings):
        torch.mm(x, x)
    assert "rollout_step" in timings
    names = [event.name for event in prof.events()]
    assert "rollout_step" in names and "aten::mm" in names
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    (marked,) = [e for e in events if e.get("name") == "rollout_step"]
    (mm,) = [e for e in events if e.get("name") == "aten::mm"]
    assert marked["ts"] <= mm["ts"] and mm["ts"] + mm["dur"] <= marked["ts"] + marked["dur"]  # mm inside


def test_marked_timer_adds_no_range_without_a_profiler(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: calls.append(name))
    timings = {}
    with marked_timer("quiet", timings):
        pass
    assert calls == [] and "quiet" in timings

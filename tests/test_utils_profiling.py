"""trellis.utils.profiling: a torch profiler block that leaves a Chrome trace behind."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch

from trellis.utils.profiling import profile
from trellis.utils.timing import marked_timer


def trace_names(path):
    with open(path) as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def test_profile_writes_a_chrome_trace_of_the_block(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    x = torch.randn(8, 8)
    with profile(tmp_path / "traces", record_shapes=True) as handle:
        assert handle.profiler is not None
        with marked_timer("actor_update", {}):
            torch.mm(x, x)
    assert handle.trace_path is not None
    assert os.path.dirname(handle.trace_path) == str(tmp_path / "traces")
    assert os.path.basename(handle.trace_path).startswith(f"trace_rank0_pid{os.getpid()}_")
    assert {"actor_update", "aten::mm"} <= trace_names(handle.trace_path)
    with open(handle.trace_path) as f:
        (mm,) = [e for e in json.load(f)["traceEvents"] if e.get("name") == "aten::mm"]
    assert mm["args"]["Input Dims"] == [[8, 8], [8, 8]]  # record_shapes reached the profiler


def test_profile_filename_activity_names_and_a_failing_block(tmp_path):
    with (
        pytest.raises(RuntimeError, match="step failed"),
        profile(tmp_path, activities=["cpu"], filename="t.json"),
    ):
        torch.ones(3).sum()
        raise RuntimeError("step failed")
    assert os.listdir(tmp_path) == ["t.json"]  # written anyway: the trace of a failure is useful
    assert "aten::sum" in trace_names(tmp_path / "t.json")


def test_profile_disabled_writes_nothing(tmp_path):
    with profile(tmp_path / "traces", enabled=False) as handle:
        torch.ones(3).sum()
    assert (handle.profiler, handle.trace_path) == (None, None)
    assert not (tmp_path / "traces").exists()
    handle.step()  # harmless


def test_profile_into_a_url(tmp_path):
    with profile("memory://traces/run1", filename="r.json") as handle:
        torch.ones(4).sum()
    try:
        assert handle.trace_path == "memory://traces/run1/r.json"
        assert b"aten::sum" in fsspec.filesystem("memory").cat("/traces/run1/r.json")
    finally:
        fsspec.filesystem("memory").rm("/traces", recursive=True)


def test_profile_unknown_activity(tmp_path):
    unknown = r"Unknown profiler activity 'gpu'; use one of cpu, cuda, xpu, mtia"
    with pytest.raises(ValueError, match=unknown), profile(tmp_path, activities=["gpu"]):
        pass

"""The built-in device backends against trellis.testing.DeviceBackendContract; the contract's own teeth."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trellis.cli import main
from trellis.device.cpu import CPUBackend
from trellis.device.cuda import CUDABackend
from trellis.registries import device_backends
from trellis.testing import DeviceBackendContract
from trellis.testing.device import FakeAccelerator


class TestCPUBackend(DeviceBackendContract):
    backend_name = "cpu"
    backend_class = CPUBackend
    expect_available = True


class TestCUDABackend(DeviceBackendContract):
    """Unavailable on a CPU-only machine (the refusal path); the available path on a GPU machine."""

    backend_name = "cuda"
    backend_class = CUDABackend


class TestCUDABackendOnFakeCUDA(DeviceBackendContract):
    """The available path's plumbing, with torch.cuda answering as a two-device fake."""

    backend_name = "cuda"
    expect_available = True

    @pytest.fixture(autouse=True)
    def _fake_cuda(self, monkeypatch):
        FakeAccelerator(device_count=2).patch(monkeypatch, torch.cuda)


def docs_example_backend():
    """The XPU backend class that docs/plugins.md shows a vendor writing, loaded from the docs."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if b.startswith("# my_xpu/")]
    namespace: dict = {}
    exec(compile(code, "docs/plugins.md", "exec"), namespace)
    return namespace["XPUBackend"]


class TestDocsExampleBackendOnFakeXPU(DeviceBackendContract):
    """The docs' example backend honours the contract (torch.xpu faked as a one-device accelerator)."""

    backend_class = docs_example_backend()
    expect_available = True

    @pytest.fixture(autouse=True)
    def _fake_xpu(self, monkeypatch):
        FakeAccelerator(device_count=1).patch(monkeypatch, torch.xpu)


class TestUnregisteredBackendClass(DeviceBackendContract):
    """backend_class alone: registration tests skip, the rest run (resolved by module:Class reference)."""

    backend_class = CPUBackend


def test_builtins_come_through_entry_points():
    rows = {(e.name, e.provider, e.target) for e in device_backends.entries()}
    assert ("cpu", "trellis-rl", "trellis.device.cpu:CPUBackend") in rows
    assert ("cuda", "trellis-rl", "trellis.device.cuda:CUDABackend") in rows
    assert device_backends.get("cpu") is CPUBackend and device_backends.get("cuda") is CUDABackend


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_doctor_shows_availability_and_the_reason(capsys):
    main(["doctor"])
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()]
    assert ["backend", "available", "priority", "reason"] in rows
    assert ["cpu", "yes", "0"] in rows
    (cuda,) = [row for row in rows if row[:1] == ["cuda"]]
    assert cuda[:3] == ["cuda", "no", "10"]
    assert cuda[3] == CUDABackend().unavailable_reason()


def run_contract(pytester, body):
    """Run a contract subclass in a child pytest; returns {test name: outcome}, result."""
    pytester.makepyfile(
        test_contract="import time\nfrom trellis.device.cpu import CPUBackend, CPUEvent\n"
        "from trellis.testing import DeviceBackendContract\n" + body
    )
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    reports = result.reprec.getreports("pytest_runtest_logreport")
    return {r.nodeid.split("::")[-1]: r.outcome for r in reports if r.when == "call"}, result


def test_contract_catches_a_misbehaving_backend(pytester):
    got, result = run_contract(
        pytester,
        "class SecondsEvent(CPUEvent):\n"
        "    def elapsed_time(self, end):\n"
        "        return (end._ns - self._ns) / 1e9  # seconds, not ms, and no checks\n"
        "class Sloppy(CPUBackend):\n"
        "    '''A backend with mistakes.'''\n"
        "    name = 'sloppy'\n"
        "    priority = 'high'\n"
        "    communication_backend = 'tcp'\n"
        "    def unavailable_reason(self):\n"
        "        return 'it is Tuesday'\n"
        "    def is_available(self):\n"
        "        return True\n"
        "    def Event(self, enable_timing=False):\n"
        "        return SecondsEvent(enable_timing)\n"
        "    def memory_reserved(self, device=None):\n"
        "        return -1\n"
        "class TestSloppy(DeviceBackendContract):\n"
        "    backend_class = Sloppy\n",
    )
    assert got["test_attributes"] == "failed"
    assert got["test_reason_is_given_iff_unavailable"] == "failed"
    assert got["test_events_time_real_work"] == "failed"
    assert got["test_elapsed_time_refuses_events_it_cannot_time"] == "failed"
    assert got["test_memory_figures"] == "failed"
    assert got["test_devices"] == got["test_streams"] == got["test_fits_protocol"] == "passed"
    result.stdout.fnmatch_lines(["*priority must be an int, got 'high'*"])
    result.stdout.fnmatch_lines(["*is it in milliseconds?*"])


def test_contract_catches_an_unavailable_backend_that_claims_devices(pytester):
    got, result = run_contract(
        pytester,
        "class Absent(CPUBackend):\n"
        "    '''Never here.'''\n"
        "    name = 'absent'\n"
        "    def unavailable_reason(self):\n"
        "        return 'the absent driver is missing'\n"
        "class TestAbsent(DeviceBackendContract):\n"
        "    backend_class = Absent\n"
        "    expect_available = True\n",
    )
    assert got["test_unavailable_backend_is_refused_with_its_reason"] == "failed"  # device_count() is 1
    assert got["test_availability_is_as_expected"] == "failed"
    assert got["test_reason_is_given_iff_unavailable"] == "passed"
    assert got["test_events_time_real_work"] == "skipped"
    result.stdout.fnmatch_lines(["*an unavailable backend sees no devices*"])

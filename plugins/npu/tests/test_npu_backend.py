"""The npu backend against the device-backend contract: as installed here, and on a fake torch_npu.

Without torch_npu (any CI machine) the first contract run takes the unavailable path; the
second replaces torch_npu and ``torch.npu`` with fakes at the import boundary, so the available
path — device selection, events, streams, memory — runs everywhere too.
"""

from __future__ import annotations

import builtins
import importlib.util
import subprocess
import sys
import types

import pytest
import torch
from trellis_npu.backend import NPUBackend

from trellis.device import (
    DeviceError,
    DeviceUnavailableError,
    clear_device_backend_cache,
    get_communication_backend,
    get_device_backend,
    get_device_name,
    get_torch_device,
)
from trellis.testing import DeviceBackendContract
from trellis.testing.device import FakeAccelerator

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv("TRELLIS_DEVICE", raising=False)
    clear_device_backend_cache()
    yield
    clear_device_backend_cache()


@pytest.fixture
def fake_npu(monkeypatch):
    """torch_npu replaced by an empty module and torch.npu by a one-device fake accelerator."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    fake = FakeAccelerator(device_count=1, name="Fake Ascend 910B")
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake


@pytest.fixture
def no_torch_npu(monkeypatch):
    """torch_npu made unimportable, as on a machine without it (None in sys.modules blocks the import)."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


class TestNPUBackendAsInstalled(DeviceBackendContract):
    """Unavailable here (no torch_npu); on an Ascend machine the same class runs the available path."""

    backend_name = "npu"
    backend_class = NPUBackend


class TestNPUBackendOnFakeTorchNPU(DeviceBackendContract):
    backend_name = "npu"
    backend_class = NPUBackend
    expect_available = True

    @pytest.fixture(autouse=True)
    def _fake_torch_npu(self, fake_npu):
        return fake_npu


def test_attributes():
    backend = NPUBackend()
    assert (backend.name, backend.priority, backend.device_type) == ("npu", 20, "npu")
    assert backend.communication_backend == "hccl"
    assert backend.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert backend.ray_resource == "NPU"


def test_without_torch_npu_it_says_so_and_is_refused(no_torch_npu):
    backend = NPUBackend()
    assert backend.is_available() is False
    assert backend.unavailable_reason() == (
        f"torch_npu is not installed (install the torch-npu release that matches torch "
        f"{torch.__version__} and your CANN toolkit)"
    )
    assert backend.device_count() == 0
    with pytest.raises(
        DeviceUnavailableError, match=r"Device backend 'npu' is not available: torch_npu is not"
    ):
        backend.set_device(0)
    with pytest.raises(DeviceUnavailableError) as caught:
        get_device_backend("npu")
    message = str(caught.value)
    assert message.startswith("Device backend 'npu' is not available: torch_npu is not installed")
    assert "Available here: cpu. Select one (trainer.device=cpu or TRELLIS_DEVICE=cpu)" in message
    assert get_device_backend().name == "cpu"  # auto-selection passes over it


def test_a_broken_torch_npu_points_at_the_cann_environment(monkeypatch):
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "torch_npu":
            raise OSError("libhccl.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing_import)
    assert NPUBackend().unavailable_reason() == (
        "torch_npu cannot be imported (OSError: libhccl.so: cannot open shared object file); check that "
        "the CANN toolkit's environment is set (source .../ascend-toolkit/set_env.sh)"
    )


def test_no_device_names_the_mask(fake_npu, monkeypatch):
    monkeypatch.setattr(fake_npu, "_count", 0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert NPUBackend().unavailable_reason() == (
        "torch.npu.is_available() is False: no Ascend NPU driver or device (ASCEND_RT_VISIBLE_DEVICES='')"
    )


def test_auto_selection_prefers_an_available_npu(fake_npu):
    backend = get_device_backend()
    assert isinstance(backend, NPUBackend)
    assert (get_device_name(), get_communication_backend()) == ("npu", "hccl")
    assert get_torch_device() is fake_npu
    assert backend.total_memory() == 16 * 2**30
    backend.empty_cache()
    assert fake_npu.calls["empty_cache"] == 1


def test_set_device_out_of_range_names_the_visible_devices_variable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    fake = FakeAccelerator(device_count=2)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    backend = NPUBackend()
    backend.set_device(1)
    assert backend.current_device() == 1 and fake.current_device() == 1
    with pytest.raises(
        DeviceError,
        match=r"Device index 2 is out of range: backend 'npu' sees 2 devices \(indices 0\.\.1\)\. "
        r"Check ASCEND_RT_VISIBLE_DEVICES",
    ):
        backend.set_device(2)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_listing_and_importing_import_neither_torch_nor_torch_npu():
    done = run_python(
        "import sys\n"
        "from trellis.registries import device_backends\n"
        "import trellis_npu.backend\n"
        "heavy = sorted(m for m in ('torch', 'torch_npu') if m in sys.modules)\n"
        "print('npu' in device_backends.names(), heavy)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True []"


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_doctor_lists_npu_as_unavailable_with_the_reason():
    done = subprocess.run(
        [sys.executable, "-m", "trellis", "doctor"], capture_output=True, text=True, timeout=300
    )
    rows = [line.split(None, 3) for line in done.stdout.splitlines()]
    (npu,) = [row for row in rows if row[:1] == ["npu"]]
    assert npu[:3] == ["npu", "no", "20"]
    assert npu[3].startswith("torch_npu is not installed")

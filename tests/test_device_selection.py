"""trellis.device.selection: explicit name > TRELLIS_DEVICE > highest available priority; the accessors."""

from __future__ import annotations

import logging

import pytest

from trellis.device import (
    DeviceUnavailableError,
    clear_device_backend_cache,
    get_communication_backend,
    get_device_backend,
    get_device_id,
    get_device_name,
    get_torch_device,
)
from trellis.device.cpu import CPUBackend, CPUTorchModule
from trellis.errors import UnknownComponentError
from trellis.registries import device_backends


def fake_backend(name, priority, reason=None, *, communication="gloo"):
    """A CPU-like backend called ``name``; unavailable with ``reason`` when one is given."""
    checks = []

    def unavailable_reason(self):
        checks.append(name)
        return reason

    return type(
        f"Fake_{name}",
        (CPUBackend,),
        {
            "name": name,
            "priority": priority,
            "device_type": name,
            "communication_backend": communication,
            "unavailable_reason": unavailable_reason,
            "checks": checks,
        },
    )


@pytest.fixture
def register(monkeypatch):
    """register(name, priority, reason=None) adds an in-process backend for this test only."""
    monkeypatch.delenv("TRELLIS_DEVICE", raising=False)
    clear_device_backend_cache()
    added = []

    def add(name, priority, reason=None, **kwargs):
        cls = kwargs.pop("cls", None) or fake_backend(name, priority, reason, **kwargs)
        device_backends.register(name, cls)
        added.append(name)
        return cls

    yield add
    for name in added:
        device_backends.unregister(name)
    clear_device_backend_cache()


def test_auto_selects_the_available_backend_with_the_highest_priority(register):
    register("zz_fast", 50)
    register("zz_fastest", 90, reason="the zz driver is not loaded")
    register("zz_slow", 5)
    backend = get_device_backend()
    assert type(backend).__name__ == "Fake_zz_fast"
    assert get_device_backend(None) is backend and get_device_backend("auto") is backend
    assert get_device_backend(" AUTO ") is backend


def test_equal_priorities_go_to_the_alphabetically_first_name(register):
    register("zz_b", 50)
    register("zz_a", 50)
    assert get_device_backend().name == "zz_a"


def test_auto_selection_is_made_once_per_process(register):
    cls = register("zz_once", 50)
    assert get_device_backend() is get_device_backend()
    assert cls.checks == ["zz_once"]  # asked once, then remembered
    clear_device_backend_cache()
    get_device_backend()
    assert cls.checks == ["zz_once", "zz_once"]


def test_environment_variable_overrides_auto_and_the_argument_overrides_both(register, monkeypatch):
    register("zz_fast", 50)
    monkeypatch.setenv("TRELLIS_DEVICE", "cpu")
    assert isinstance(get_device_backend(), CPUBackend) and get_device_backend().name == "cpu"
    assert get_device_backend("auto").name == "cpu"  # trainer.device=auto defers to the variable
    assert get_device_backend("zz_fast").name == "zz_fast"
    monkeypatch.setenv("TRELLIS_DEVICE", "auto")
    assert get_device_backend().name == "zz_fast"
    monkeypatch.setenv("TRELLIS_DEVICE", "")
    assert get_device_backend().name == "zz_fast"


def test_explicit_unavailable_backend_is_an_error_with_reason_and_alternatives(register):
    register("zz_gpu", 90, reason="the zz driver is not loaded")
    register("zz_fast", 50)
    with pytest.raises(DeviceUnavailableError) as caught:
        get_device_backend("zz_gpu")
    assert str(caught.value) == (
        "Device backend 'zz_gpu' is not available: the zz driver is not loaded. Available here: "
        f"zz_fast, {_others('zz_fast')}. Select one (trainer.device=zz_fast or TRELLIS_DEVICE=zz_fast), "
        "or 'auto' to take the best available one."
    )
    assert isinstance(caught.value, RuntimeError)


def _others(*skip):
    """The real backends available here after the test ones, best first (cpu, or cuda and cpu)."""
    names = [n for n in ("cuda", "cpu") if n not in skip]
    return ", ".join(n for n in names if device_backends.get(n)().is_available())


def test_unavailable_backend_from_the_environment_says_where_it_came_from(register, monkeypatch):
    register("zz_gpu", 90, reason="the zz driver is not loaded")
    monkeypatch.setenv("TRELLIS_DEVICE", "zz_gpu")
    with pytest.raises(
        DeviceUnavailableError,
        match=r"^Device backend 'zz_gpu' \(from the environment variable TRELLIS_DEVICE\) is not available: "
        r"the zz driver is not loaded\. Available here: ",
    ):
        get_device_backend()


def test_unknown_names_raise_the_registry_error(register, monkeypatch):
    with pytest.raises(
        UnknownComponentError, match=r"^Unknown device backend 'cdua'\. Available: .*cpu, cuda"
    ) as caught:
        get_device_backend("cdua")
    assert caught.value.closest == "cuda"
    monkeypatch.setenv("TRELLIS_DEVICE", "gpu")
    with pytest.raises(UnknownComponentError) as caught:
        get_device_backend()
    message = str(caught.value)
    assert message.startswith("TRELLIS_DEVICE='gpu': Unknown device backend 'gpu'. Available: ")
    assert message.endswith(" Or unset TRELLIS_DEVICE to select automatically.")
    assert caught.value.name == "gpu" and "cpu" in caught.value.available


def test_a_name_must_be_a_string(register):
    with pytest.raises(
        TypeError, match=r"Device backend name must be a string such as 'cuda', or None/'auto', got 0"
    ):
        get_device_backend(0)


def test_a_reference_works_like_a_name(register):
    backend = get_device_backend("trellis.device.cpu:CPUBackend")
    assert type(backend) is CPUBackend
    assert get_device_backend("trellis.device.cpu:CPUBackend") is backend


def test_one_instance_per_name_per_process(register):
    assert get_device_backend("cpu") is get_device_backend("cpu")
    first = get_device_backend("cpu")
    clear_device_backend_cache()
    assert get_device_backend("cpu") is not first


def test_reregistering_a_name_is_not_shadowed_by_a_stale_instance(register):
    register("zz_dev", 50)
    old = get_device_backend("zz_dev")
    device_backends.register("zz_dev", fake_backend("zz_dev", 60), replace=True)
    assert get_device_backend("zz_dev") is not old


def test_broken_backends_are_skipped_in_auto_selection_with_a_warning(register, caplog):
    class Exploding(CPUBackend):
        name = "zz_boom"
        priority = 99

        def is_available(self):
            raise RuntimeError("driver 550 too old")

    class Unbuildable(CPUBackend):
        name = "zz_unbuildable"
        priority = 98

        def __init__(self):
            raise OSError("libzz.so missing")

    register("zz_boom", 0, cls=Exploding)
    register("zz_unbuildable", 0, cls=Unbuildable)
    register("zz_ok", 50)
    with caplog.at_level(logging.WARNING, logger="trellis.device.selection"):
        assert get_device_backend().name == "zz_ok"
    assert (
        "Device backend 'zz_boom': asking whether it is available raised RuntimeError: driver 550 too old"
        in (caplog.text)
    )
    assert "Device backend 'zz_unbuildable' is skipped: it failed to load: libzz.so missing" in caplog.text
    with pytest.raises(DeviceUnavailableError, match="asking whether it is available raised RuntimeError"):
        get_device_backend("zz_boom")  # named explicitly: an error, not a skip


def test_when_nothing_is_available(register, monkeypatch):
    register("zz_none", 1, reason="no zz here")
    monkeypatch.setattr(device_backends, "names", lambda: ["zz_none"])
    with pytest.raises(DeviceUnavailableError) as caught:
        get_device_backend()
    assert str(caught.value) == (
        "No device backend is available (installed: zz_none). The built-in 'cpu' backend always is; "
        "reinstall trellis-rl if it is missing, and run 'trellis doctor'."
    )
    with pytest.raises(
        DeviceUnavailableError, match=r"no zz here\. No other backend is available here either"
    ):
        get_device_backend("zz_none")


def test_accessors_follow_the_selected_backend(register, monkeypatch):
    monkeypatch.setenv("TRELLIS_DEVICE", "cpu")
    assert (get_device_name(), get_device_id(), get_communication_backend()) == ("cpu", 0, "gloo")
    assert isinstance(get_torch_device(), CPUTorchModule)
    register("zz_fast", 50, communication="hccl")
    monkeypatch.delenv("TRELLIS_DEVICE")
    assert (get_device_name(), get_device_id(), get_communication_backend()) == ("zz_fast", 0, "hccl")


@pytest.mark.parametrize(
    "code",
    [
        "import trellis.device",
        "from trellis.registries import device_backends; device_backends.names(); device_backends.entries()",
        "import trellis.device as d; d.get_device_backend('cpu').synchronize(); d.get_device_name.__doc__",
        "from trellis.device import CPUBackend, CUDABackend, TorchAcceleratorBackend; CUDABackend()",
    ],
)
def test_importing_and_listing_do_not_import_torch(python, code):
    done = python(f"{code}\nimport sys\nprint('torch' in sys.modules)", env={"TRELLIS_DEVICE": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_the_environment_variable_reaches_a_fresh_process(python):
    done = python(
        "from trellis.device import get_device_backend; print(get_device_backend().name)",
        env={"TRELLIS_DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"

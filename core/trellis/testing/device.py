"""Contract tests for a device backend, and a fake accelerator to run them without the hardware.

    from trellis.testing import DeviceBackendContract

    class TestNPUBackend(DeviceBackendContract):
        backend_name = "npu"          # resolved through the trellis.device_backends registry

Every test runs on any machine: the available-path tests skip where the backend is not
available, and the unavailable-path tests skip where it is. Run the class again with the vendor
namespace replaced by :class:`FakeAccelerator` to exercise the available path in CI.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

from trellis.testing.registry import RegistryEntryContract

__all__ = ["KNOWN_COMMUNICATION_BACKENDS", "DeviceBackendContract", "FakeAccelerator"]

KNOWN_COMMUNICATION_BACKENDS = ("gloo", "nccl", "hccl", "mpi", "ucc", "xccl", "cncl")
"""``torch.distributed`` backends the contract accepts (extend per class if yours is newer)."""

# What DeviceBackend defines beyond the registry's (deliberately minimal) structural check.
INTERFACE_METHODS = (
    "is_available",
    "unavailable_reason",
    "device_count",
    "current_device",
    "set_device",
    "memory_allocated",
    "memory_reserved",
    "total_memory",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "empty_cache",
    "synchronize",
    "Event",
    "Stream",
    "current_stream",
    "stream",
)


TEMPORARY_NAME = "trellis-contract-backend"
"""The in-process name a contract registers a bare ``backend_class`` under while it runs."""


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


class DeviceBackendContract(RegistryEntryContract):
    """Proves a device backend honours :class:`trellis.device.DeviceBackend`.

    Class attributes to set in the subclass:
        backend_name: the name it registers in ``trellis.device_backends`` (e.g. ``"npu"``).
        backend_class: the class itself, to test one that is not (yet) registered; with
            ``backend_name`` too, the registry must resolve the name to this class.
        expect_available: True / False to also assert availability on this machine; None
            (default) tests whichever path applies.
        work_seconds: how long :meth:`device_work` keeps the device busy for the timing test.
        known_communication_backends: accepted ``communication_backend`` values.

    Override :meth:`device_work` to time real kernels instead of a host sleep.
    """

    registry: ClassVar[str] = "device_backends"
    backend_name: ClassVar[str | None] = None
    backend_class: ClassVar[type | None] = None
    expect_available: ClassVar[bool | None] = None
    work_seconds: ClassVar[float] = 0.05
    known_communication_backends: ClassVar[tuple[str, ...]] = KNOWN_COMMUNICATION_BACKENDS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.backend_name is not None:
            cls.name = cls.backend_name  # what the registry-entry tests check

    # -- helpers

    def _component(self) -> Any:
        if self.backend_class is not None:
            return self.backend_class
        if self.backend_name is None:
            raise TypeError(f"{type(self).__name__}: set backend_name = 'NAME' or backend_class = Class.")
        return self._registry().get(self.backend_name)

    @contextlib.contextmanager
    def _selectable(self) -> Iterator[str]:
        """A name get_device_backend() resolves to the backend, with a fresh selection cache.

        ``backend_name`` itself; for a bare ``backend_class``, a temporary in-process registration.
        """
        from trellis.device import clear_device_backend_cache
        from trellis.registries import device_backends

        name = self.backend_name or TEMPORARY_NAME
        if self.backend_name is None:
            device_backends.register(name, self._component(), replace=True)
        clear_device_backend_cache()
        try:
            yield name
        finally:
            clear_device_backend_cache()
            if self.backend_name is None:
                device_backends.unregister(name)

    def make_backend(self) -> Any:
        """A fresh instance (no selection cache), so per-test fakes are seen."""
        return self._component()()

    def _available_backend(self) -> Any:
        backend = self.make_backend()
        if not backend.is_available():
            _skip(f"{backend.name!r} is not available here: {backend.unavailable_reason()}")
        return backend

    def device_work(self, backend: Any, seconds: float) -> None:
        """Keep ``backend``'s current stream busy for about ``seconds``. Default: a host sleep,
        which an event pair on an idle stream measures too. Override to launch real kernels."""
        time.sleep(seconds)

    # -- registration

    def test_is_listed(self) -> None:
        if self.backend_name is None:
            _skip("backend_class without backend_name: registration is not checked")
        super().test_is_listed()

    def test_resolves_in_fresh_process(self) -> None:
        if self.backend_name is None:
            _skip("backend_class without backend_name: registration is not checked")
        super().test_resolves_in_fresh_process()

    def test_name_matches_registration(self) -> None:
        cls = self._component()
        if self.backend_name is not None:
            assert cls.name == self.backend_name, (
                f"{cls.__qualname__}.name is {cls.name!r} but it is registered as {self.backend_name!r}; "
                "make them equal (error messages and trainer.device use the name)."
            )
            if self.backend_class is not None:
                resolved = self._registry().get(self.backend_name)
                assert resolved is self.backend_class, (
                    f"The registry resolves {self.backend_name!r} to {resolved!r}, "
                    f"not {self.backend_class!r}."
                )

    def test_has_the_whole_interface(self) -> None:
        cls = self._component()
        missing = [m for m in INTERFACE_METHODS if not callable(getattr(cls, m, None))]
        assert not missing, (
            f"{cls.__qualname__} lacks DeviceBackend methods {missing}; subclass DeviceBackend."
        )
        assert "torch_module" in dir(cls), f"{cls.__qualname__} has no torch_module property."

    # -- attributes and presence

    def test_attributes(self) -> None:
        backend = self.make_backend()
        assert isinstance(backend.name, str) and backend.name, (
            f"name must be a non-empty str: {backend.name!r}"
        )
        assert isinstance(backend.priority, int) and not isinstance(backend.priority, bool), (
            f"priority must be an int, got {backend.priority!r}"
        )
        assert isinstance(backend.device_type, str) and backend.device_type.isidentifier(), (
            f"device_type must be a torch device type such as 'cuda', got {backend.device_type!r}"
        )
        assert backend.communication_backend in self.known_communication_backends, (
            f"communication_backend {backend.communication_backend!r} is not a known torch.distributed "
            f"backend {self.known_communication_backends}; set known_communication_backends if it is new."
        )
        env = backend.visible_devices_env
        assert env is None or (isinstance(env, str) and env.isidentifier() and env.isupper()), (
            f"visible_devices_env must be None or an environment variable name, got {env!r}"
        )
        resource = backend.ray_resource
        assert resource is None or (isinstance(resource, str) and resource), (
            f"ray_resource must be None or a Ray resource name, got {resource!r}"
        )

    def test_instantiates_without_arguments_and_answers(self) -> None:
        backend = self.make_backend()  # `trellis doctor` does exactly this
        available = backend.is_available()
        assert isinstance(available, bool), f"is_available() must return a bool, got {available!r}"
        reason = backend.unavailable_reason()
        assert reason is None or isinstance(reason, str), f"unavailable_reason() returned {reason!r}"

    def test_reason_is_given_iff_unavailable(self) -> None:
        backend = self.make_backend()
        reason = backend.unavailable_reason()
        if backend.is_available():
            assert reason is None, f"available, yet unavailable_reason() says {reason!r}"
        else:
            assert isinstance(reason, str) and reason.strip(), (
                "unavailable, so unavailable_reason() must say why in a sentence"
            )

    def test_availability_is_as_expected(self) -> None:
        if self.expect_available is None:
            _skip("expect_available is None: either answer is fine here")
        backend = self.make_backend()
        assert backend.is_available() is self.expect_available, (
            f"expected {backend.name!r} to be {'' if self.expect_available else 'un'}available; "
            f"unavailable_reason(): {backend.unavailable_reason()!r}"
        )

    def test_unavailable_backend_is_refused_with_its_reason(self) -> None:
        from trellis.device import DeviceUnavailableError, get_device_backend

        backend = self.make_backend()
        if backend.is_available():
            _skip(f"{backend.name!r} is available here")
        reason = backend.unavailable_reason()
        assert backend.device_count() == 0, "an unavailable backend sees no devices: device_count() must be 0"
        with self._selectable() as name:
            try:
                get_device_backend(name)
            except DeviceUnavailableError as exc:
                assert reason in str(exc), f"the error does not give the reason {reason!r}: {exc}"
            else:
                raise AssertionError(f"get_device_backend({name!r}) did not raise DeviceUnavailableError")

    # -- the available path

    def test_selectable_by_name(self) -> None:
        from trellis.device import get_device_backend

        self._available_backend()
        with self._selectable() as name:
            selected = get_device_backend(name)
            assert isinstance(selected, self._component())
            assert selected.is_available()

    def test_devices(self) -> None:
        from trellis.device import DeviceError

        backend = self._available_backend()
        count = backend.device_count()
        assert isinstance(count, int) and count >= 1, (
            f"available, so device_count() must be >= 1, got {count!r}"
        )
        current = backend.current_device()
        assert isinstance(current, int) and 0 <= current < count, f"current_device() is {current!r}"
        backend.set_device(current)
        assert backend.current_device() == current
        if count > 1:
            backend.set_device(count - 1)
            try:
                assert backend.current_device() == count - 1
            finally:
                backend.set_device(current)
        try:
            backend.set_device(-1)
        except (DeviceError, ValueError):
            pass
        else:
            raise AssertionError(
                "set_device(-1) must raise DeviceError (or ValueError), naming the valid range"
            )
        assert backend.torch_module is not None

    def test_events_time_real_work(self) -> None:
        backend = self._available_backend()
        start, middle, end = (backend.Event(enable_timing=True) for _ in range(3))
        start.record()
        middle.record()  # nothing between start and middle
        self.device_work(backend, self.work_seconds)
        end.record()
        end.synchronize()
        assert end.query() is True
        idle_ms, busy_ms = start.elapsed_time(middle), middle.elapsed_time(end)
        assert isinstance(busy_ms, float), f"elapsed_time() must return a float of ms, got {busy_ms!r}"
        assert 0 <= idle_ms < busy_ms, f"elapsed_time does not grow with work: {idle_ms} ms then {busy_ms} ms"
        assert busy_ms >= 0.5 * self.work_seconds * 1000, (
            f"{self.work_seconds * 1000:.0f} ms of work measured as {busy_ms:.3f} ms: is it in milliseconds?"
        )

    def test_elapsed_time_refuses_events_it_cannot_time(self) -> None:
        from trellis.device import DeviceError

        backend = self._available_backend()
        start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        start.record()
        for misuse in (lambda: start.elapsed_time(end), lambda: end.elapsed_time(start)):
            try:
                misuse()
            except DeviceError as exc:
                assert "not been recorded" in str(exc), str(exc)
            else:
                raise AssertionError("elapsed_time() with an unrecorded event must raise DeviceError")
        untimed = backend.Event()
        untimed.record()
        try:
            start.elapsed_time(untimed)
        except DeviceError as exc:
            assert "enable_timing" in str(exc), str(exc)
        else:
            raise AssertionError(
                "elapsed_time() with an event made without enable_timing must raise DeviceError"
            )

    def test_streams(self) -> None:
        backend = self._available_backend()
        before = backend.current_stream()
        side = backend.Stream()
        ready = backend.Event()
        ready.record()
        side.wait_event(ready)
        side.wait_stream(before)
        with backend.stream(side):
            assert backend.current_stream() == side, "inside stream(s), current_stream() must be s"
            self.device_work(backend, 0.001)
            done = backend.Event()
            done.record(side)
        assert backend.current_stream() == before, "leaving stream(s) must restore the previous stream"
        with backend.stream(None):
            assert backend.current_stream() == before
        side.synchronize()
        assert side.query() is True and done.query() is True
        before.wait_stream(side)
        backend.synchronize()

    def test_memory_figures(self) -> None:
        backend = self._available_backend()
        index = backend.current_device()
        figures = {
            "memory_allocated": backend.memory_allocated(),
            "memory_reserved": backend.memory_reserved(),
            "total_memory": backend.total_memory(),
            "memory_allocated(index)": backend.memory_allocated(index),
            "total_memory(index)": backend.total_memory(index),
            "max_memory_allocated": backend.max_memory_allocated(),
        }
        for what, value in figures.items():
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (
                f"{what} must be a non-negative int of bytes, got {value!r}"
            )
        assert figures["total_memory"] > 0, "total_memory() must be the device's memory in bytes"
        assert figures["memory_reserved"] >= figures["memory_allocated"], figures
        assert backend.reset_peak_memory_stats() is None
        assert backend.max_memory_allocated() >= 0

    def test_empty_cache_and_synchronize(self) -> None:
        backend = self._available_backend()
        assert backend.empty_cache() is None
        assert backend.synchronize() is None


# ---------------------------------------------------------------- a fake accelerator


class FakeAccelerator:
    """A ``torch.cuda``-shaped namespace for an accelerator of ``device_count`` devices that
    runs on the host: enough to exercise a backend's available path without the hardware.

    Install it where the backend looks, with pytest's ``monkeypatch``::

        fake = FakeAccelerator()
        monkeypatch.setattr(torch, "npu", fake, raising=False)   # a namespace torch lacks
        fake.patch(monkeypatch, torch.cuda)                       # or over an existing one

    Events timestamp with ``time.perf_counter_ns()`` when recorded and, like torch's, refuse to
    time an unrecorded event or one made without ``enable_timing``. Memory figures are the
    attributes ``allocated``, ``reserved`` and ``total`` (bytes). ``calls`` counts calls by name.
    """

    # is_initialized is left out on purpose: over torch.cuda, a True answer would make torch run
    # its queued CUDA initialisation (e.g. seeding every device) against the missing hardware.
    API = (
        "is_available",
        "device_count",
        "current_device",
        "set_device",
        "synchronize",
        "empty_cache",
        "memory_allocated",
        "memory_reserved",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "get_device_properties",
        "Event",
        "Stream",
        "stream",
        "current_stream",
    )

    def __init__(self, device_count: int = 1, *, total: int = 16 * 2**30, name: str = "Fake Accelerator"):
        self._count = device_count
        self._current = 0
        self.allocated = 3 * 2**20
        self.reserved = 4 * 2**20
        self.total = total
        self.device_name = name
        self.calls: dict[str, int] = {}
        default = self.Stream()
        self._stack = [default]
        fake = self

        class Event(_FakeEvent):
            accelerator = fake

        self.Event = Event

    def patch(self, monkeypatch: Any, target: Any) -> None:
        """Replace each name of :attr:`API` on ``target`` (e.g. ``torch.cuda``) with this fake's."""
        for name in self.API:
            monkeypatch.setattr(target, name, getattr(self, name), raising=False)

    def _count_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _check(self, device: Any) -> int:
        index = self._current if device is None else int(getattr(device, "index", device))
        if not 0 <= index < self._count:
            raise RuntimeError(
                f"invalid device ordinal {index} (fake accelerator with {self._count} devices)"
            )
        return index

    def is_available(self) -> bool:
        return self._count > 0

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return self._current

    def set_device(self, device: Any) -> None:
        self._count_call("set_device")
        self._current = self._check(device)

    def synchronize(self, device: Any = None) -> None:
        self._count_call("synchronize")

    def empty_cache(self) -> None:
        self._count_call("empty_cache")

    def memory_allocated(self, device: Any = None) -> int:
        self._check(device)
        return self.allocated

    def memory_reserved(self, device: Any = None) -> int:
        self._check(device)
        return self.reserved

    def max_memory_allocated(self, device: Any = None) -> int:
        self._check(device)
        return self.allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._count_call("reset_peak_memory_stats")
        self._check(device)

    def get_device_properties(self, device: Any = None) -> Any:
        self._check(device)
        return SimpleNamespace(name=self.device_name, total_memory=self.total)

    def Stream(
        self, device: Any = None, priority: int = 0
    ) -> _FakeStream:  # capitalised like torch.cuda.Stream
        return _FakeStream(self._current if device is None else self._check(device))

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self._stack[-1]

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream | None) -> Iterator[_FakeStream | None]:
        if stream is None:
            yield None
            return
        if not isinstance(stream, _FakeStream):
            raise TypeError(f"fake stream() expected a fake stream, got {stream!r}")
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()


class _FakeStream:
    """A fake native stream: host work is already ordered, so waiting is free."""

    def __init__(self, device: int):
        self.device = device
        self.waited_on: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited_on.append(event)

    def wait_stream(self, stream: Any) -> None:
        self.waited_on.append(stream)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _FakeEvent:
    """A fake native event (``FakeAccelerator().Event``), timed on the host."""

    accelerator: ClassVar[FakeAccelerator]

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.ns: int | None = None
        self.stream: _FakeStream | None = None

    def record(self, stream: _FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else self.accelerator.current_stream()
        self.ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: _FakeEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.ns is None or end_event.ns is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.ns - self.ns) / 1e6

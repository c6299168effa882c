"""A base for accelerators whose torch namespace is shaped like ``torch.cuda``.

``torch.cuda``, ``torch.npu`` (torch_npu), ``torch.xpu`` and others share one API: ``device_count``,
``set_device``, ``memory_allocated``, ``Event``, ``Stream``, ``stream``, ... A backend for such a
device subclasses :class:`TorchAcceleratorBackend`, sets the class attributes, and writes two
methods: ``unavailable_reason()`` (which imports its vendor modules, lazily) and
``_load_torch_module()``. Everything else — index checks, memory figures, event and stream
wrappers — is here, once.
"""

from __future__ import annotations

import contextlib
from typing import Any

from trellis.device.base import (
    DeviceBackend,
    DeviceEvent,
    DeviceStream,
    DeviceUnavailableError,
    check_device_index,
)

__all__ = ["AcceleratorEvent", "AcceleratorStream", "TorchAcceleratorBackend"]


class AcceleratorEvent(DeviceEvent):
    """A :class:`DeviceEvent` around the native event (``torch.cuda.Event``), kept as ``native``."""

    def __init__(self, module: Any, enable_timing: bool = False):
        super().__init__(enable_timing)
        self.native = module.Event(enable_timing=self.enable_timing)

    def record(self, stream: DeviceStream | None = None) -> None:
        """Record on ``stream`` (default: the current stream)."""
        self.native.record(_native_stream(stream, "Event.record()"))
        self.recorded = True

    def synchronize(self) -> None:
        """Block the host until the device has reached this event."""
        self.native.synchronize()

    def query(self) -> bool:
        """True when the device has reached this event."""
        return bool(self.native.query())

    def elapsed_time(self, end_event: DeviceEvent) -> float:
        """Milliseconds between this event and ``end_event`` on the device; waits for ``end_event``."""
        self._check_timing_pair(end_event)
        end_native = end_event.native  # type: ignore[attr-defined]  # same type: checked above
        end_native.synchronize()  # the device refuses to time an event it has not reached
        return float(self.native.elapsed_time(end_native))


class AcceleratorStream(DeviceStream):
    """A :class:`DeviceStream` around the native stream (``torch.cuda.Stream``), kept as ``native``.

    Two wrappers are equal when they wrap the same native stream.
    """

    def __init__(self, native: Any):
        self.native = native

    def wait_event(self, event: DeviceEvent) -> None:
        """Order later work on this stream after ``event``."""
        if isinstance(event, AcceleratorEvent):
            self.native.wait_event(event.native)
        elif isinstance(event, DeviceEvent):
            raise TypeError(
                "Stream.wait_event() needs an event from this backend's Event(), "
                f"got a {type(event).__name__}."
            )
        else:
            self.native.wait_event(event)  # a native event: pass it through

    def wait_stream(self, other: DeviceStream) -> None:
        """Order later work on this stream after the work queued on ``other`` so far."""
        native = _native_stream(other, "Stream.wait_stream()")
        if native is None:
            raise TypeError("Stream.wait_stream() needs a stream, got None.")
        self.native.wait_stream(native)

    def synchronize(self) -> None:
        """Block the host until this stream's work is complete."""
        self.native.synchronize()

    def query(self) -> bool:
        """True when this stream's work is complete."""
        return bool(self.native.query())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AcceleratorStream):
            return bool(self.native == other.native)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.native)

    def __repr__(self) -> str:
        return f"<AcceleratorStream {self.native!r}>"


def _native_stream(stream: Any, where: str) -> Any:
    """The native stream inside ``stream`` (None stays None; a native stream passes through)."""
    if stream is None:
        return None
    if isinstance(stream, AcceleratorStream):
        return stream.native
    if isinstance(stream, DeviceStream):
        raise TypeError(
            f"{where} needs a stream from this backend's Stream() or current_stream(), "
            f"got a {type(stream).__name__}."
        )
    return stream


class TorchAcceleratorBackend(DeviceBackend):
    """A device reached through a ``torch.cuda``-shaped namespace (``torch.cuda``, ``torch.npu``, ...).

    Subclasses set the class attributes and implement:

    * ``unavailable_reason()`` — import the vendor modules *here* (never at module level) and
      return None or one sentence;
    * ``_load_torch_module()`` — return the namespace; called only once the backend is available.

    On an unavailable backend ``device_count()`` is 0 and every other device call raises
    :class:`~trellis.device.base.DeviceUnavailableError` with the reason.
    """

    def _load_torch_module(self) -> Any:
        """The torch namespace of this device, e.g. ``torch.cuda``. Only called when available."""
        raise NotImplementedError

    def _module(self) -> Any:
        # Availability is asked every time rather than cached: it is cheap, and a cached answer
        # goes stale across fork() and in tests that fake the hardware.
        reason = self.unavailable_reason()
        if reason is not None:
            raise DeviceUnavailableError(
                f"Device backend {self.name!r} is not available: {reason}. Run 'trellis doctor' to see "
                f"which backends are, and select one with trainer.device=NAME (or TRELLIS_DEVICE=NAME), "
                f"or 'auto'."
            )
        return self._load_torch_module()

    def _index(self, device: int | None) -> int:
        if device is None:
            return self.current_device()
        return check_device_index(self, device, self.device_count())

    @property
    def torch_module(self) -> Any:
        """The device's torch namespace; raises DeviceUnavailableError when unavailable."""
        return self._module()

    def device_count(self) -> int:
        """Devices this process sees (after ``visible_devices_env`` masking); 0 when unavailable."""
        if not self.is_available():
            return 0
        return int(self._module().device_count())

    def current_device(self) -> int:
        return int(self._module().current_device())

    def set_device(self, index: int) -> None:
        """Make device ``index`` current; raises DeviceError (naming the valid range) when out of range."""
        module = self._module()
        module.set_device(check_device_index(self, index, int(module.device_count())))

    def memory_allocated(self, device: int | None = None) -> int:
        return int(self._module().memory_allocated(self._index(device)))

    def memory_reserved(self, device: int | None = None) -> int:
        return int(self._module().memory_reserved(self._index(device)))

    def total_memory(self, device: int | None = None) -> int:
        return int(self._module().get_device_properties(self._index(device)).total_memory)

    def max_memory_allocated(self, device: int | None = None) -> int:
        return int(self._module().max_memory_allocated(self._index(device)))

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        self._module().reset_peak_memory_stats(self._index(device))

    def empty_cache(self) -> None:
        self._module().empty_cache()

    def synchronize(self) -> None:
        self._module().synchronize()

    def Event(self, enable_timing: bool = False) -> AcceleratorEvent:  # capitalised like torch.cuda.Event
        return AcceleratorEvent(self._module(), enable_timing=enable_timing)

    def Stream(self) -> AcceleratorStream:  # capitalised like torch.cuda.Stream
        return AcceleratorStream(self._module().Stream())

    def current_stream(self) -> AcceleratorStream:
        return AcceleratorStream(self._module().current_stream())

    def stream(self, stream: DeviceStream | None) -> contextlib.AbstractContextManager[Any]:
        if stream is None:
            return contextlib.nullcontext()
        native = _native_stream(stream, f"{type(self).__name__}.stream()")
        return self._module().stream(native)

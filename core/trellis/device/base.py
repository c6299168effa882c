"""The device-backend protocol: what Trellis asks of a kind of hardware, and nothing more.

A backend is a class registered in ``trellis.device_backends`` (entry points, like every other
component) whose instances answer three kinds of questions:

* **Is it here?** ``is_available()`` and, when not, ``unavailable_reason()`` — one sentence a
  person can act on. Both are cheap, never raise, and work on machines without the hardware's
  Python packages: a backend imports its vendor modules (``torch_npu``, ...) only inside methods.
* **Who am I?** Class attributes: ``name`` (the registry name), ``priority`` (higher wins in
  auto-selection), ``device_type`` (the torch device type, ``"cuda"``), ``communication_backend``
  (the ``torch.distributed`` backend, ``"nccl"``), ``visible_devices_env`` (the variable that
  masks devices, ``"CUDA_VISIBLE_DEVICES"``) and ``ray_resource`` (the Ray resource, ``"GPU"``).
* **Do it.** Device selection, memory figures, synchronisation, and :class:`DeviceEvent` /
  :class:`DeviceStream` wrappers with one behaviour on every backend.

Backends whose torch namespace mirrors ``torch.cuda`` (``torch.npu``, ``torch.xpu``, ...)
subclass :class:`trellis.device.accelerator.TorchAcceleratorBackend` and write a dozen lines.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar

from trellis.errors import DeviceError, DeviceUnavailableError

__all__ = ["DeviceBackend", "DeviceError", "DeviceEvent", "DeviceStream", "DeviceUnavailableError"]


class DeviceEvent:
    """A marker in a stream of device work, for synchronisation and timing.

    Made by ``backend.Event(enable_timing=...)``. ``record`` places it after the work queued so
    far; ``synchronize`` blocks the host until that work is complete; ``elapsed_time`` measures
    between two recorded events. Every backend checks the same misuse the same way, so code that
    runs on CPU does not fail later on an accelerator.
    """

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = bool(enable_timing)
        self.recorded = False

    def record(self, stream: DeviceStream | None = None) -> None:
        """Place the event after the work queued on ``stream`` (default: the current stream)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until the work before this event is complete."""
        raise NotImplementedError

    def query(self) -> bool:
        """True when the work before this event is complete (also for an unrecorded event)."""
        raise NotImplementedError

    def elapsed_time(self, end_event: DeviceEvent) -> float:
        """Milliseconds from this event to ``end_event``; waits for ``end_event`` to complete.

        Raises:
            DeviceError: either event was made without ``enable_timing=True`` or not yet recorded.
        """
        raise NotImplementedError

    def _check_timing_pair(self, end_event: DeviceEvent) -> None:
        """Raise :class:`DeviceError` unless both events can be timed against each other."""
        if not isinstance(end_event, type(self)):
            raise DeviceError(
                f"elapsed_time() needs an end event of the same backend ({type(self).__name__}); got "
                f"{type(end_event).__name__}. Make both with the same backend's Event(enable_timing=True)."
            )
        for which, event in (("start", self), ("end", end_event)):
            if not event.enable_timing:
                raise DeviceError(
                    f"elapsed_time(): the {which} event was made with enable_timing=False. "
                    "Make both events with backend.Event(enable_timing=True)."
                )
            if not event.recorded:
                raise DeviceError(
                    f"elapsed_time(): the {which} event has not been recorded yet. Call start.record() "
                    "before the work to time and end.record() after it, then start.elapsed_time(end)."
                )


class DeviceStream:
    """An ordered queue of device work. Made by ``backend.Stream()`` or ``backend.current_stream()``.

    Work queued on one stream runs in order; ``wait_event`` / ``wait_stream`` order it after
    work on another stream. Make a stream current with ``with backend.stream(s): ...``.
    """

    def wait_event(self, event: DeviceEvent) -> None:
        """Make work queued on this stream from now on wait until ``event`` has completed."""
        raise NotImplementedError

    def wait_stream(self, other: DeviceStream) -> None:
        """Make work queued on this stream from now on wait for all work queued on ``other`` so far."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream is complete."""
        raise NotImplementedError

    def query(self) -> bool:
        """True when all work queued on this stream is complete."""
        raise NotImplementedError


class DeviceBackend:
    """One kind of hardware (cpu, cuda, npu, ...), as the rest of Trellis uses it.

    Subclass it, set the class attributes, implement the methods, and declare the class as an
    entry point in group ``trellis.device_backends``. The constructor takes no arguments and does
    no work: ``trellis doctor`` instantiates every backend to ask ``is_available()``.

    Device indices are local to the process's view (after ``visible_devices_env`` masking);
    ``device=None`` in the memory methods means the current device. Memory is in bytes.
    """

    name: ClassVar[str]
    """The registry name, e.g. ``"cuda"``; also what ``trainer.device`` and ``TRELLIS_DEVICE`` take."""
    priority: ClassVar[int] = 0
    """Auto-selection picks the available backend with the highest priority (cpu 0, cuda 10, npu 20)."""
    device_type: ClassVar[str]
    """The torch device type: ``torch.device(device_type, index)`` addresses a device."""
    communication_backend: ClassVar[str]
    """The ``torch.distributed`` backend for collectives: ``"gloo"``, ``"nccl"``, ``"hccl"``, ..."""
    visible_devices_env: ClassVar[str | None] = None
    """The environment variable that masks which devices a process sees; None when there is none."""
    ray_resource: ClassVar[str | None] = None
    """The Ray resource name one device is scheduled as (``"GPU"``, ``"NPU"``); None for CPU."""

    # -- presence

    def is_available(self) -> bool:
        """True when this process can use the hardware. Never raises."""
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """None when available; otherwise one sentence saying why, e.g. ``"torch_npu is not installed"``."""
        raise NotImplementedError

    @property
    def torch_module(self) -> Any:
        """The device's torch namespace (``torch.cuda``, ``torch.npu``), for device-specific extras.

        Portable code calls the backend's own methods instead.
        """
        raise NotImplementedError

    # -- devices

    def device_count(self) -> int:
        """How many devices this process sees; 0 when the backend is unavailable."""
        raise NotImplementedError

    def current_device(self) -> int:
        """The index of this process's current device."""
        raise NotImplementedError

    def set_device(self, index: int) -> None:
        """Make device ``index`` current for this process (usually its local rank)."""
        raise NotImplementedError

    # -- memory, in bytes

    def memory_allocated(self, device: int | None = None) -> int:
        """Bytes held by live tensors on ``device``."""
        raise NotImplementedError

    def memory_reserved(self, device: int | None = None) -> int:
        """Bytes held by the allocator on ``device`` (live tensors plus its cache); >= allocated."""
        raise NotImplementedError

    def total_memory(self, device: int | None = None) -> int:
        """The device's total memory in bytes."""
        raise NotImplementedError

    def max_memory_allocated(self, device: int | None = None) -> int:
        """The most bytes live tensors have held on ``device`` since the process started or since
        :meth:`reset_peak_memory_stats`."""
        raise NotImplementedError

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        """Start :meth:`max_memory_allocated` over from what is allocated now."""
        raise NotImplementedError

    def empty_cache(self) -> None:
        """Give the allocator's cached, unused memory back to the device."""
        raise NotImplementedError

    # -- ordering and timing

    def synchronize(self) -> None:
        """Block the host until all work queued on the current device is complete."""
        raise NotImplementedError

    def Event(self, enable_timing: bool = False) -> DeviceEvent:  # capitalised like torch.cuda.Event
        """A new, unrecorded :class:`DeviceEvent`."""
        raise NotImplementedError

    def Stream(self) -> DeviceStream:  # capitalised like torch.cuda.Stream
        """A new :class:`DeviceStream` on the current device."""
        raise NotImplementedError

    def current_stream(self) -> DeviceStream:
        """The stream work is queued on now (the default stream unless inside ``stream(s)``)."""
        raise NotImplementedError

    def stream(self, stream: DeviceStream | None) -> AbstractContextManager[Any]:
        """A context manager that makes ``stream`` current inside it; ``None`` changes nothing."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


def check_device_index(backend: DeviceBackend, index: Any, count: int) -> int:
    """``index`` as an int in ``[0, count)``; raises TypeError / DeviceError naming the fix otherwise."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(
            f"Device index must be an int (e.g. the local rank), got {index!r} "
            f"of type {type(index).__name__}."
        )
    if not 0 <= index < count:
        mask = (
            f" Check {backend.visible_devices_env} (it decides which devices this process sees)."
            if backend.visible_devices_env
            else ""
        )
        seen = f"indices 0..{count - 1}" if count else "no devices"
        raise DeviceError(
            f"Device index {index} is out of range: backend {backend.name!r} sees {count} device"
            f"{'' if count == 1 else 's'} ({seen}).{mask}"
        )
    return index

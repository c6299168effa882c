"""The ``cpu`` backend: always available, and honest about what a CPU does.

CPU work runs in program order on the calling thread, so by the time a Python call returns its
work is done. That makes most ordering operations no-ops *for a reason*, not by omission:
``synchronize()`` has nothing to wait for, an event is complete the moment it is recorded, and a
stream waiting on an event or another stream is already after it. Events still measure real
time: ``record()`` takes a ``time.perf_counter_ns()`` timestamp, so ``elapsed_time`` is the
wall-clock time between two ``record()`` calls.

Memory figures are the nearest honest ones a CPU has (see :mod:`trellis.utils.memory`):
allocated = the process's resident set size, reserved and max allocated = its peak RSS, total =
physical memory. The allocator cache is glibc ``malloc``'s free memory: ``empty_cache()`` gives it
back to the OS (``malloc_trim``).

Nothing here imports torch, except :attr:`CPUBackend.torch_module` when it is used.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

from trellis.device.base import DeviceBackend, DeviceError, DeviceEvent, DeviceStream
from trellis.utils.memory import (
    peak_rss_bytes,
    physical_memory_bytes,
    reset_peak_rss,
    rss_bytes,
    trim_malloc_heaps,
)

__all__ = [
    "CPUBackend",
    "CPUEvent",
    "CPUStream",
    "CPUTorchModule",
    "flushes_denormal",
    "native_bf16",
    "set_flush_denormal",
]

# /proc/cpuinfo flags of CPUs that compute bf16 matrix products in hardware: x86 AVX512-BF16 and
# AMX (flags line), Arm's BF16 extension (Features line)
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 matrix products natively (AVX512-BF16, AMX or Arm BF16).

    Without them torch emulates bf16 matmuls, several times slower than fp32 (about 6x measured on
    an AVX-512 Xeon without AVX512-BF16), so bf16 only pays where this is True. Reads
    ``/proc/cpuinfo`` (or ``cpuinfo``, the text of one); False where it cannot be read.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and _BF16_FLAGS & set(value.split()):
            return True
    return False


def flushes_denormal() -> bool:
    """Whether the calling thread flushes denormal floats to zero (x86 FTZ/DAZ, Arm FZ).

    Probed by computing with one: torch has a setter, no getter.
    """
    import torch

    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0


def set_flush_denormal(enabled: bool) -> bool:
    """Flush denormal floats to zero (or stop) on the calling thread; returns the setting before.

    Denormals (magnitudes under 1.2e-38 in fp32) take a slow microcode path on x86 cores, around 100
    times slower than normal numbers, and a softmax over a large vocabulary makes millions of them
    (every probability under e^-87 of the largest): its backward, and the elementwise operations
    that meet them, slowed a SmolLM2 GRPO update (1 thread) from 17 s to 30 s. Flushing changes results
    only below 1.2e-38. It is a register of the calling thread, inherited by the threads it starts
    later: set before the first parallel region, it reaches torch's OpenMP workers too (they are
    started then); set after, they keep the setting they started with. A CPU without the mode
    (``torch.set_flush_denormal`` returns False) is left as it is.
    """
    import torch

    before = flushes_denormal()
    if enabled != before:
        torch.set_flush_denormal(enabled)
    return before


class CPUEvent(DeviceEvent):
    """An event on the CPU: recording it takes a ``time.perf_counter_ns()`` timestamp.

    It is complete as soon as it is recorded (the work before it already ran), so ``query()``
    is always True and ``synchronize()`` returns at once.
    """

    def __init__(self, enable_timing: bool = False):
        super().__init__(enable_timing)
        self._ns: int | None = None

    def record(self, stream: DeviceStream | None = None) -> None:
        """Timestamp now; ``stream`` must be a :class:`CPUStream` or None (all are sequential)."""
        _check_stream(stream, "CPUEvent.record()")
        self._ns = time.perf_counter_ns()
        self.recorded = True

    def synchronize(self) -> None:
        """Return at once: the work before ``record()`` finished before ``record()`` ran."""

    def query(self) -> bool:
        """Always True: there is never pending CPU work behind an event."""
        return True

    def elapsed_time(self, end_event: DeviceEvent) -> float:
        """Milliseconds of wall-clock time from this event's ``record()`` to ``end_event``'s."""
        self._check_timing_pair(end_event)
        end_ns = cast(CPUEvent, end_event)._ns  # same type: checked above
        assert end_ns is not None and self._ns is not None  # both recorded: checked above
        return (end_ns - self._ns) / 1e6


class CPUStream(DeviceStream):
    """A CPU stream: work on it runs in program order, like all CPU work.

    ``wait_event`` and ``wait_stream`` are no-ops because everything queued before them on any
    stream has already run; ``synchronize`` has nothing to wait for.
    """

    def wait_event(self, event: DeviceEvent) -> None:
        """No-op: the work before a recorded CPU event has already completed."""
        if not isinstance(event, CPUEvent):
            raise TypeError(
                f"CPUStream.wait_event() needs an event from the cpu backend's Event(), got {event!r}."
            )

    def wait_stream(self, other: DeviceStream) -> None:
        """No-op: work queued on ``other`` so far has already run."""
        _check_stream(other, "CPUStream.wait_stream()", allow_none=False)

    def synchronize(self) -> None:
        """Return at once: CPU work on a stream is done when the call that queued it returns."""

    def query(self) -> bool:
        """Always True."""
        return True


def _check_stream(stream: Any, where: str, allow_none: bool = True) -> None:
    if stream is None and allow_none:
        return
    if not isinstance(stream, CPUStream):
        raise TypeError(
            f"{where} needs a stream from the cpu backend's Stream() or current_stream(), got {stream!r}."
        )


def _check_cpu_index(index: Any) -> int:
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(
            f"Device index must be an int (e.g. the local rank), got {index!r} "
            f"of type {type(index).__name__}."
        )
    if index < 0:
        raise DeviceError(f"Device index must be >= 0 (e.g. the local rank), got {index}.")
    return index


class CPUBackend(DeviceBackend):
    """The host CPU: one device (index 0) shared by every process, collectives over gloo.

    Always available. ``set_device(i)`` accepts any local rank and leaves the current device at
    0, so worker code that calls ``set_device(local_rank)`` runs unchanged on CPU with several
    processes. Memory figures are RSS (allocated), peak RSS (reserved, max allocated) and
    physical memory (total), in bytes.
    """

    name = "cpu"
    priority = 0
    device_type = "cpu"
    communication_backend = "gloo"
    visible_devices_env = None
    ray_resource = None

    def __init__(self) -> None:
        self._default_stream = CPUStream()
        self._local = threading.local()  # current-stream stack, per thread like torch's
        self._torch_module = CPUTorchModule(self)

    def unavailable_reason(self) -> str | None:
        """Always None: every machine has a CPU."""
        return None

    @property
    def torch_module(self) -> CPUTorchModule:
        """A ``torch.cuda``-shaped namespace for the CPU (see :class:`CPUTorchModule`)."""
        return self._torch_module

    def device_count(self) -> int:
        """1: the host is one device."""
        return 1

    def current_device(self) -> int:
        """0, always."""
        return 0

    def set_device(self, index: int) -> None:
        """Accept any non-negative index (all processes share the host); the current device stays 0."""
        _check_cpu_index(index)

    def memory_allocated(self, device: int | None = None) -> int:
        """The process's resident set size (RSS) in bytes."""
        if device is not None:
            _check_cpu_index(device)
        return rss_bytes()

    def memory_reserved(self, device: int | None = None) -> int:
        """The process's peak RSS in bytes (never below the current RSS)."""
        if device is not None:
            _check_cpu_index(device)
        return max(peak_rss_bytes(), rss_bytes())

    def total_memory(self, device: int | None = None) -> int:
        """The machine's physical memory in bytes."""
        if device is not None:
            _check_cpu_index(device)
        return physical_memory_bytes()

    def max_memory_allocated(self, device: int | None = None) -> int:
        """The process's peak RSS in bytes (never below the current RSS)."""
        return self.memory_reserved(device)

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        """Reset the process's peak RSS to its current RSS (Linux; elsewhere the peak is kept)."""
        if device is not None:
            _check_cpu_index(device)
        reset_peak_rss()

    def empty_cache(self) -> None:
        """Give the free memory glibc's ``malloc`` keeps in its heaps back to the OS (``malloc_trim``).

        The host's allocator cache: torch's CPU tensors come from ``malloc``, which keeps freed blocks
        below its mmap threshold (up to 32 MiB) in its heaps, resident, for later requests. Training
        steps of varying shapes leave them fragmented, and a run's resident set grew by gigabytes over
        its first steps (docs/performance.md, "Memory"). Engines call this when a phase ends
        (:meth:`trellis.engine.base.TrainingEngine.phase`). A no-op without glibc.
        """
        trim_malloc_heaps()

    def synchronize(self) -> None:
        """No-op: CPU work is complete when the call that did it returns."""

    def Event(self, enable_timing: bool = False) -> CPUEvent:  # capitalised like torch.cuda.Event
        """A new :class:`CPUEvent`."""
        return CPUEvent(enable_timing=enable_timing)

    def Stream(self) -> CPUStream:  # capitalised like torch.cuda.Stream
        """A new :class:`CPUStream`."""
        return CPUStream()

    def current_stream(self) -> CPUStream:
        """The innermost stream made current with ``stream(s)`` on this thread, else the default one."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self._default_stream

    def stream(self, stream: DeviceStream | None) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current inside the ``with`` block (``None``: change nothing)."""
        if stream is None:
            return contextlib.nullcontext()
        _check_stream(stream, "CPUBackend.stream()")
        return self._stream_context(stream)

    @contextlib.contextmanager
    def _stream_context(self, stream: DeviceStream) -> Iterator[DeviceStream]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()


class CPUTorchModule:
    """What ``get_torch_device()`` returns on CPU: the ``torch.cuda`` calls that training code
    makes, answered for the CPU, so such code runs unchanged; anything else comes from ``torch.cpu``.

    ``manual_seed``, ``get_rng_state`` and ``set_rng_state`` act on torch's CPU generator;
    memory figures are the backend's (RSS, peak RSS); ``empty_cache`` trims malloc's heaps (the
    backend's); ``synchronize`` is a no-op; ``current_device()`` is 0 (where
    ``torch.cpu.current_device()`` says ``"cpu"``).
    """

    def __init__(self, backend: CPUBackend):
        self._backend = backend

    def __repr__(self) -> str:
        return "<CPUTorchModule: torch.cpu with torch.cuda-style extras>"

    def __getattr__(self, name: str) -> Any:
        import torch

        try:
            return getattr(torch.cpu, name)
        except AttributeError:
            raise AttributeError(
                f"Neither the cpu backend's torch namespace nor torch.cpu has {name!r}. Call the "
                f"device backend's methods (trellis.device.get_device_backend()) for portable code."
            ) from None

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._backend.device_count()

    def current_device(self) -> int:
        return self._backend.current_device()

    def set_device(self, index: int) -> None:
        self._backend.set_device(index)

    def synchronize(self, device: Any = None) -> None:
        self._backend.synchronize()

    def empty_cache(self) -> None:
        self._backend.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        return self._backend.memory_allocated()

    def memory_reserved(self, device: Any = None) -> int:
        return self._backend.memory_reserved()

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._backend.max_memory_allocated()

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._backend.max_memory_allocated()

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._backend.reset_peak_memory_stats()

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def get_rng_state(self, device: Any = None) -> Any:
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, new_state: Any, device: Any = None) -> None:
        import torch

        torch.set_rng_state(new_state)

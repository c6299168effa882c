"""How much memory the device holds, and giving its cached memory back, on the selected backend.

Every figure comes from a :class:`~trellis.device.base.DeviceBackend` (by default
:func:`~trellis.device.get_device_backend`, the one this process uses), so a plugin's device
reports its own memory. On the ``cpu`` backend the figures are the nearest honest ones a CPU
has: allocated = the process's resident set size (RSS), reserved and max allocated = its peak
RSS, total = the machine's physical memory (:mod:`trellis.utils.memory`).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from trellis.device.base import DeviceBackend
from trellis.device.selection import get_device_backend
from trellis.utils.logging import get_rank
from trellis.utils.memory import GIB

__all__ = ["aggressive_empty_cache", "device_memory_usage", "log_device_memory_usage"]

_logger = logging.getLogger(__name__)


def device_memory_usage(backend: DeviceBackend | None = None) -> dict[str, Any]:
    """Memory of this process's current device, in GiB (2**30 bytes).

    Args:
        backend: the backend to ask; None = the selected one (:func:`~trellis.device.get_device_backend`).

    Returns:
        ``{"device": "cuda:0" | "npu:1" | "cpu", "allocated_gib": ..., "reserved_gib": ...,
        "max_allocated_gib": ..., "total_gib": ...}``: the backend's ``memory_allocated``,
        ``memory_reserved``, ``max_memory_allocated`` and ``total_memory``. On CPU: allocated =
        process RSS, reserved = max allocated = peak RSS, total = physical memory.
    """
    backend = backend or get_device_backend()
    index = backend.current_device()
    return {
        "device": _device_name(backend, index),
        "allocated_gib": backend.memory_allocated(index) / GIB,
        "reserved_gib": backend.memory_reserved(index) / GIB,
        "max_allocated_gib": backend.max_memory_allocated(index) / GIB,
        "total_gib": backend.total_memory(index) / GIB,
    }


def log_device_memory_usage(
    head: str,
    logger: logging.Logger | None = None,
    level: int = logging.DEBUG,
    rank: int = 0,
    backend: DeviceBackend | None = None,
) -> dict[str, Any] | None:
    """Log ``"<head>: <device> memory allocated X GiB, reserved Y GiB, total Z GiB"``, on rank ``rank`` only.

    ``logger`` defaults to this module's logger (``trellis.device.memory``); at the default
    DEBUG level the line shows only when that logger is set to DEBUG, so calls can stay in
    the code. Returns the :func:`device_memory_usage` figures on the logging rank, None on the others.
    """
    if get_rank() != rank:
        return None
    backend = backend or get_device_backend()
    usage = device_memory_usage(backend)
    on_cpu = backend.device_type == "cpu"
    (logger or _logger).log(
        level,
        "%s: %s memory allocated %.2f GiB%s, reserved %.2f GiB%s, total %.2f GiB%s",
        head,
        usage["device"],
        usage["allocated_gib"],
        " (process RSS)" if on_cpu else "",
        usage["reserved_gib"],
        " (peak RSS)" if on_cpu else "",
        usage["total_gib"],
        " (physical)" if on_cpu else "",
    )
    return usage


def aggressive_empty_cache(
    force_sync: bool = True, max_retries: int = 3, backend: DeviceBackend | None = None
) -> dict[str, Any]:
    """Collect garbage and return the device's cached memory, repeating while it keeps helping.

    Each pass runs ``gc.collect()``, then the backend's ``synchronize()`` (when ``force_sync``,
    so that memory of finished kernels can be released) and ``empty_cache()``. Passes repeat, up
    to ``max_retries`` in all, while they make progress: the collector found garbage (freeing
    objects can make more unreachable) or reserved memory dropped. A device runtime not started
    in this process (``torch.cuda.is_initialized()`` False) has nothing cached: only the
    collector runs, and no device is touched (which would start the runtime).

    Args:
        backend: the backend to empty; None = the selected one.

    Returns:
        ``{"device", "passes", "gc_collected", "reserved_before_gib", "reserved_after_gib",
        "freed_gib"}``: reserved is the backend's ``memory_reserved`` (0 before the runtime
        starts); on CPU that is the peak RSS, which freeing does not lower.

    Raises:
        ValueError: ``max_retries`` < 1.
    """
    if max_retries < 1:
        raise ValueError(f"max_retries must be at least 1, got {max_retries}.")
    backend = backend or get_device_backend()
    started = _runtime_started(backend)

    def reserved() -> int:
        return backend.memory_reserved() if started else 0

    start = before = reserved()
    collected = passes = 0
    while passes < max_retries:
        passes += 1
        found = gc.collect()
        collected += found
        if started:
            if force_sync:
                backend.synchronize()
            backend.empty_cache()
            # torch.cuda-shaped namespaces also free memory other processes held through IPC handles
            ipc_collect = getattr(backend.torch_module, "ipc_collect", None)
            if callable(ipc_collect):
                ipc_collect()
        after = reserved()
        progress = found > 0 or after < before
        before = after
        if not progress:
            break
    return {
        "device": _device_name(backend, backend.current_device()) if started else backend.device_type,
        "passes": passes,
        "gc_collected": collected,
        "reserved_before_gib": start / GIB,
        "reserved_after_gib": before / GIB,
        "freed_gib": max(0, start - before) / GIB,
    }


def _device_name(backend: DeviceBackend, index: int) -> str:
    """``"cuda:0"``; the host is one device, named ``"cpu"`` as torch names it."""
    return "cpu" if backend.device_type == "cpu" else f"{backend.device_type}:{index}"


def _runtime_started(backend: DeviceBackend) -> bool:
    """False when the backend's namespace says its runtime has not started in this process
    (``is_initialized()``, as ``torch.cuda`` and ``torch.npu`` have); True where it cannot say."""
    is_initialized = getattr(backend.torch_module, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else True

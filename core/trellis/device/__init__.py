"""Device backends: one interface to the CPU, CUDA GPUs, and whatever a plugin adds (Ascend NPUs, ...).

    from trellis.device import get_device_backend

    backend = get_device_backend()          # trainer.device, else $TRELLIS_DEVICE, else the best
    backend.set_device(local_rank)
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    start.record(); ...; end.record()
    print(start.elapsed_time(end), "ms on", backend.device_type)

Backends are classes in the ``trellis.device_backends`` registry (built-ins ``cpu`` and ``cuda``;
plugins add more through entry points). The protocol is :class:`DeviceBackend`; the selection
rule is in :mod:`trellis.device.selection`: an explicit name, else the ``TRELLIS_DEVICE``
environment variable, else the available backend with the highest ``priority``.

Importing ``trellis.device`` does not import torch; backends import it inside their methods.
"""

from __future__ import annotations

from trellis.device.base import (
    DeviceBackend,
    DeviceError,
    DeviceEvent,
    DeviceStream,
    DeviceUnavailableError,
)
from trellis.device.selection import (
    AUTO,
    ENV_VAR,
    clear_device_backend_cache,
    get_communication_backend,
    get_device_backend,
    get_device_id,
    get_device_name,
    get_torch_device,
)
from trellis.utils.lazy import lazy_attributes

# public name -> "module:attr", imported on first access
_LAZY: dict[str, str] = {
    "CPUBackend": "trellis.device.cpu:CPUBackend",
    "CUDABackend": "trellis.device.cuda:CUDABackend",
    "TorchAcceleratorBackend": "trellis.device.accelerator:TorchAcceleratorBackend",
}

__all__ = [
    "AUTO",
    "ENV_VAR",
    "DeviceBackend",
    "DeviceError",
    "DeviceEvent",
    "DeviceStream",
    "DeviceUnavailableError",
    "clear_device_backend_cache",
    "get_communication_backend",
    "get_device_backend",
    "get_device_id",
    "get_device_name",
    "get_torch_device",
    *_LAZY,
]

__getattr__, __dir__ = lazy_attributes("trellis.device", _LAZY, globals())

"""The ``cuda`` backend: NVIDIA (and ROCm) GPUs through ``torch.cuda``; collectives over NCCL.

torch is imported only inside methods, so this module imports on any machine, and
``is_available()`` answers False with a reason where there is no usable GPU.
"""

from __future__ import annotations

import os
from typing import Any

from trellis.device.accelerator import TorchAcceleratorBackend

__all__ = ["CUDABackend"]


class CUDABackend(TorchAcceleratorBackend):
    """GPUs through ``torch.cuda``: available iff ``torch.cuda.is_available()``.

    Devices are masked with ``CUDA_VISIBLE_DEVICES``, scheduled in Ray as ``GPU`` and joined by
    NCCL. Memory figures come from torch's caching allocator, in bytes.
    """

    name = "cuda"
    priority = 10
    device_type = "cuda"
    communication_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"

    def unavailable_reason(self) -> str | None:
        """None when ``torch.cuda.is_available()``; else why not (no CUDA build, no driver or device)."""
        try:
            import torch
        except Exception as exc:  # a broken torch install must not break `trellis doctor`
            return f"torch cannot be imported ({type(exc).__name__}: {exc}); install torch"
        try:
            if torch.cuda.is_available():
                return None
        except Exception as exc:
            return f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
        reason = "torch.cuda.is_available() is False: no CUDA driver or device"
        version = getattr(torch, "version", None)
        if getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None:
            reason += f" (this torch build, {torch.__version__}, has no CUDA support; install a CUDA build)"
        elif os.environ.get(self.visible_devices_env) is not None:
            reason += f" ({self.visible_devices_env}={os.environ[self.visible_devices_env]!r})"
        return reason

    def _load_torch_module(self) -> Any:
        import torch

        return torch.cuda

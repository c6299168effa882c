"""The ``npu`` device backend: Ascend NPUs through torch_npu's ``torch.npu``; collectives over HCCL.

torch and torch_npu are imported only inside methods, so this plugin installs and lists on any
machine and reports itself unavailable, with the reason, where torch_npu or an NPU is missing.
``torch.npu`` mirrors ``torch.cuda``, so everything but the presence check comes from
:class:`trellis.device.TorchAcceleratorBackend`.
"""

from __future__ import annotations

import os
from typing import Any

from trellis.device import TorchAcceleratorBackend

__all__ = ["NPUBackend"]


class NPUBackend(TorchAcceleratorBackend):
    """Ascend NPUs: available iff torch_npu imports and ``torch.npu.is_available()``.

    Devices are masked with ``ASCEND_RT_VISIBLE_DEVICES``, scheduled in Ray as ``NPU`` and
    joined by HCCL. Priority 20 puts it ahead of cuda (10) and cpu (0) in auto-selection.
    """

    name = "npu"
    priority = 20
    device_type = "npu"
    communication_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"

    def unavailable_reason(self) -> str | None:
        """None when torch_npu imports and sees an NPU; else why not, e.g. "torch_npu is not installed"."""
        try:
            import torch
        except Exception as exc:  # a broken torch install must not break `trellis doctor`
            return f"torch cannot be imported ({type(exc).__name__}: {exc}); install torch"
        try:
            import torch_npu  # noqa: F401  (importing it adds torch.npu)
        except ModuleNotFoundError as exc:
            if exc.name != "torch_npu":
                return f"torch_npu cannot be imported: it needs the missing module {exc.name!r}"
            return (
                "torch_npu is not installed (install the torch-npu release that matches "
                f"torch {torch.__version__} and your CANN toolkit)"
            )
        except Exception as exc:
            return (
                f"torch_npu cannot be imported ({type(exc).__name__}: {exc}); check that the CANN "
                "toolkit's environment is set (source .../ascend-toolkit/set_env.sh)"
            )
        npu = getattr(torch, "npu", None)
        if npu is None:
            return f"torch_npu imported without adding torch.npu; reinstall it for torch {torch.__version__}"
        try:
            if npu.is_available():
                return None
        except Exception as exc:
            return f"torch.npu.is_available() raised {type(exc).__name__}: {exc}"
        reason = "torch.npu.is_available() is False: no Ascend NPU driver or device"
        masked = os.environ.get(self.visible_devices_env)
        if masked is not None:
            reason += f" ({self.visible_devices_env}={masked!r})"
        return reason

    def _load_torch_module(self) -> Any:
        import torch
        import torch_npu  # noqa: F401  (importing it adds torch.npu)

        return torch.npu

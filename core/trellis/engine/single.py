"""``single``: the training engine of one process, on one device.

No parallelism: the model sits whole on ``device``, compute runs under ``torch.autocast`` in
``model.dtype`` (float32 weights, as the optimizer's master copy), and collectives are the
identity. Offload (``offload.param`` / ``offload.optimizer``, any combination) moves the whole
model / optimizer state between host memory and ``device`` at the edges of each
:meth:`~trellis.engine.base.TrainingEngine.phase`. Everything else (micro-batching, packing,
losses, optimizer, state) is :class:`~trellis.engine.base.TrainingEngine`'s.
"""

from __future__ import annotations

import contextlib

import torch

from trellis.engine.base import HOST, TrainingEngine
from trellis.engine.models import sparse_tied_embedding_grad


class SingleEngine(TrainingEngine):
    """A :class:`~trellis.engine.base.TrainingEngine` in one process (registered as ``single``).

    ``SingleEngine(model_config, role_config, role="actor", total_steps=None, device=None, seed=0)``;
    ``process_group`` is ignored.
    """

    name = "single"

    def _wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        self.sparse_embedding_grad = sparse_tied_embedding_grad(module)
        return module.to(HOST if self.offload_param else self.device)  # offloaded: phases bring it in

    def _compute_context(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

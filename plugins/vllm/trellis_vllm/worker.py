"""Methods Trellis adds to each vLLM worker (``worker_extension_cls``); they run in the engine process.

vLLM mixes this class into its worker class, so the replica reaches these methods by name
through ``collective_rpc`` without sending code (no insecure pickling). Weights travel as one
flat file of raw tensor bytes in ``/dev/shm`` plus an index of ``(name, dtype, shape, offset)``
(see :func:`write_weights_file`): tensors cannot pass through ``collective_rpc`` when the engine
core is another process, and a memory-mapped file costs one copy on each side.

A weight update is a *reload session* (vLLM's layerwise in-place reload):
:meth:`TrellisWorkerExtension.trellis_load_weights` opens one on its first call and feeds each file
through the model's own ``load_weights`` (so Hugging Face names, fused projections and CPU weight
repacking are handled by vLLM); :meth:`TrellisWorkerExtension.trellis_finish_reload` closes it. A
layer whose checkpoint tensors arrive in different files (a bucket boundary inside the layer) is
processed once all of them have arrived, so the session must span the whole stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

# dtype names in the index: torch's own spelling without the "torch." prefix
_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

IndexEntry = tuple[str, str, list[int], int]  # name, dtype, shape, byte offset


def write_weights_file(
    path: str,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    aliases: dict[str, str] | None = None,
) -> list[IndexEntry]:
    """Write ``named_tensors`` to ``path`` as raw bytes, back to back; returns the index.

    Offsets are 64-byte aligned so every tensor can be viewed in place. Tensors on an accelerator
    are copied to host memory first.

    ``aliases`` maps a name to another name the same tensor is also loaded under: tied weights,
    ``{"model.embed_tokens.weight": "lm_head.weight"}``. The second name always comes from the
    first (an index entry at the same offset) and is dropped where the stream names it itself:
    vLLM loads a tied output weight only in the same call as the input embedding (it refuses it
    alone), and a sync's buckets may hold them apart.
    """
    index: list[IndexEntry] = []
    offset = 0
    aliases = dict(aliases or {})
    derived = set(aliases.values())
    with open(path, "wb") as f:
        for name, tensor in named_tensors:
            if name in derived:
                continue  # tied: loaded with (and as) its source, see above
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"update_weights: {name!r} has dtype {tensor.dtype}, which vLLM cannot load.")
            data = tensor.detach().to("cpu").contiguous()
            pad = -offset % 64
            if pad:
                f.write(b"\0" * pad)
                offset += pad
            raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
            f.write(memoryview(raw))
            index.append((name, dtype, list(data.shape), offset))
            offset += data.numel() * data.element_size()
    for entry in list(index):
        alias = aliases.get(entry[0])
        if alias is not None:
            index.append((alias, *entry[1:]))
    return index


def read_weights_file(path: str, index: list[IndexEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a file written by :func:`write_weights_file` (views of one private mapping)."""
    size = os.path.getsize(path)
    flat = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else None
    for name, dtype, shape, offset in index:
        dt = _DTYPES[dtype]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        if nbytes == 0 or flat is None:
            yield name, torch.empty(shape, dtype=dt)
            continue
        yield name, flat[offset : offset + nbytes].view(dt).view(shape)


class TrellisWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; ``self`` is the worker."""

    def trellis_load_weights(self, path: str, index: list[IndexEntry]) -> int:
        """Load one weights file into the model (opening a reload session if none is open).

        Returns the number of tensors read.
        """
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        if not getattr(self, "_trellis_reloading", False):
            initialize_layerwise_reload(model)
            self._trellis_reloading = True
        with torch.no_grad():
            model.load_weights(read_weights_file(path, index))
        return len(index)

    def trellis_finish_reload(self) -> bool:
        """Close the open reload session (process layers still pending); False when none was open."""
        if not getattr(self, "_trellis_reloading", False):
            return False
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.model_config)
        self._trellis_reloading = False
        for reset in ("reset_encoder_cache", "reset_mm_cache"):  # state derived from the old weights
            method = getattr(self.model_runner, reset, None)
            if callable(method):
                method()
        return True

    def trellis_state_checksum(self) -> float:
        """Sum of every parameter of the served model as float64 (tests compare it across updates)."""
        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum() for p in model.parameters()))

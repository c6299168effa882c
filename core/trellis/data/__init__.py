"""Data that travels between the stages of a training step: DataProto, datasets, collation.

``from trellis.data import DataProto`` works; the dataset module (which imports torch's data
utilities) is imported only when one of its names is asked for.
"""

from __future__ import annotations

from trellis.utils.lazy import lazy_attributes

_LAZY = {
    **{
        name: f"trellis.data.protocol:{name}"
        for name in ("DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto")
    },
    **{
        name: f"trellis.data.dataset:{name}"
        for name in ("RLDataset", "PromptLoader", "ResumableSampler", "collate_fn")
    },
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_attributes("trellis.data", _LAZY, globals())

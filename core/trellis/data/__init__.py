"""Data that travels between the stages of a training step: DataProto, datasets, collation.

``from trellis.data import DataProto`` works; the dataset module (which imports torch's data
utilities) is imported only when one of its names is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DataProto": "trellis.data.protocol",
    "DataProtoItem": "trellis.data.protocol",
    "pad_dataproto_to_divisor": "trellis.data.protocol",
    "unpad_dataproto": "trellis.data.protocol",
    "RLDataset": "trellis.data.dataset",
    "PromptLoader": "trellis.data.dataset",
    "ResumableSampler": "trellis.data.dataset",
    "collate_fn": "trellis.data.dataset",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trellis.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

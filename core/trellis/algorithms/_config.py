"""Reading settings from whatever config the caller has: None, a dict, a config dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_value(config: Any, key: str, default: Any) -> Any:
    """``config.get(key, default)`` for a dict or config object, else the attribute; None: ``default``."""
    if config is None:
        return default
    if isinstance(config, Mapping) or callable(getattr(config, "get", None)):
        return config.get(key, default)
    return getattr(config, key, default)

"""Reading settings from whatever config the caller has: None, a dict, a config dataclass.

Every layer reads settings this way (algorithms, engines, checkpoints, workers), so it lives in
``trellis.utils``, the bottom layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_value(config: Any, key: str, default: Any, *, none_is_default: bool = False) -> Any:
    """``config.get(key, default)`` for a dict or config object, else the attribute; None: ``default``.

    With ``none_is_default`` a stored None also gives ``default`` (config fields where null means
    "use the default").
    """
    if config is None:
        return default
    if isinstance(config, Mapping) or callable(getattr(config, "get", None)):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None and none_is_default else value


def setting(config: Any, key: str, default: Any) -> Any:
    """A setting of ``config`` where a missing or null value means ``default``."""
    return config_value(config, key, default, none_is_default=True)

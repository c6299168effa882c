"""Trellis: reinforcement-learning post-training for LLMs, as a small core plus plugins.

Importing ``trellis`` is cheap: it imports neither torch nor any subsystem. Public names
below are attributes that import their module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from trellis._version import __version__

# public name -> "module:attr" (or "module" for a submodule), imported on first access
_LAZY: dict[str, str] = {
    "Registry": "trellis.registry:Registry",
    "registries": "trellis.registries",
    "errors": "trellis.errors",
    "hooks": "trellis.hooks",
    "hookimpl": "trellis.hooks:hookimpl",
    "get_plugin_manager": "trellis.hooks:get_plugin_manager",
    "DataProto": "trellis.data.protocol:DataProto",
    "load_config": "trellis.config:load_config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'trellis' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    value = importlib.import_module(module_name)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value  # cache: later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

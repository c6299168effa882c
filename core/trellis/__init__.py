"""Trellis: reinforcement-learning post-training for LLMs, as a small core plus plugins.

Importing ``trellis`` is cheap: it imports neither torch nor any subsystem. Public names
below are attributes that import their module on first access.
"""

from __future__ import annotations

from trellis._version import __version__
from trellis.utils.lazy import lazy_attributes

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
    "train": "trellis.trainer:train",
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_attributes("trellis", _LAZY, globals())

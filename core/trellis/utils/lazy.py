"""Lazy public attributes for a package (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, targets: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names import on first access.

    ``targets`` maps a public name to ``"module:attr"`` (or ``"module"`` for a submodule);
    ``namespace`` is the package's ``globals()``, where a resolved value is cached so later
    accesses skip ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attr = target.partition(":")
        value = importlib.import_module(module_name)
        if attr:
            value = getattr(value, attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(targets))

    return __getattr__, __dir__

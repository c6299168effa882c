"""Structural checks that a registry applies to every component it loads.

A registry knows the *shape* its components must have — a class with certain methods, or a
callable that accepts certain arguments — and rejects a component that does not fit with a
message saying what is missing. The checks are structural (duck-typed) on purpose: a plugin
never has to import a Trellis base class just to be accepted, and the subsystems that own a
kind (rollout, tools, ...) can tighten the check by naming a base class.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CallableProtocol:
    """A function (or any callable) that the framework calls with fixed arguments.

    ``positional`` are passed by position, ``keywords`` by name; the callable must accept both.
    ``signature`` is the human-readable form shown in errors.
    """

    signature: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()

    def problems(self, obj: Any) -> list[str]:
        """Return what keeps ``obj`` from fitting; an empty list means it fits."""
        if inspect.isclass(obj) or not callable(obj):
            return [f"it is a {type(obj).__name__}, not a function"]
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return []  # builtins without introspectable signatures: trust them
        try:
            sig.bind(*self.positional, **dict.fromkeys(self.keywords))
        except TypeError as exc:
            return [
                f"its signature {obj.__name__ if hasattr(obj, '__name__') else 'fn'}{sig} "
                f"cannot be called that way ({exc})"
            ]
        return []


@dataclass(frozen=True)
class ClassProtocol:
    """A class that must define some methods (``async_methods`` must be coroutine functions)
    and attributes, optionally by subclassing ``base`` (a ``module:attr`` string, imported lazily).
    """

    signature: str
    methods: tuple[str, ...] = ()
    async_methods: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    base: str | None = None
    _base_cache: list[type] = field(default_factory=list, compare=False, repr=False)

    def problems(self, obj: Any) -> list[str]:
        """Return what keeps ``obj`` from fitting; an empty list means it fits."""
        if not inspect.isclass(obj):
            return [f"it is a {type(obj).__name__}, not a class"]
        found: list[str] = []
        if self.base is not None:
            base = self._resolve_base(self.base)
            if not issubclass(obj, base):
                found.append(f"it does not subclass {self.base}")
        for name in self.methods + self.async_methods:
            member = _defined_member(obj, name)
            if member is _MISSING:
                found.append(f"method '{name}' is missing")
            elif not callable(member):
                found.append(f"'{name}' is not a method")
            elif (
                name in self.async_methods
                and not inspect.iscoroutinefunction(member)
                and not inspect.isasyncgenfunction(member)
            ):
                found.append(f"method '{name}' must be 'async def'")
        for name in self.attributes:
            if _defined_member(obj, name) is _MISSING and name not in _annotations(obj):
                found.append(f"attribute '{name}' is missing")
        return found

    def _resolve_base(self, base: str) -> type:
        if not self._base_cache:
            from trellis.registry import load_reference

            self._base_cache.append(load_reference(base))
        return self._base_cache[0]


_MISSING = object()


def _defined_member(cls: type, name: str) -> Any:
    """The member ``name`` as defined by ``cls`` or a base other than ``object``; else ``_MISSING``."""
    for klass in cls.__mro__:
        if klass is object:
            break
        if name in vars(klass):
            member = vars(klass)[name]
            # staticmethod/classmethod wrappers hide the function the checks need to see.
            return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    return _MISSING


def _annotations(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
    return names

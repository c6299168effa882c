"""Named registries of components, discovered through Python entry points.

A :class:`Registry` maps names to components of one kind (advantage estimators, rollout
replicas, ...). Names come from two places:

* **entry points** of installed distributions, in the registry's group (e.g.
  ``trellis.advantage_estimators``). Listing reads metadata only; a component is imported
  the first time its name is requested. Because this goes through installed metadata, a name
  resolves the same way in the driver, a Ray worker or any subprocess.
* **in-process** ``register()`` calls, for notebooks and tests.

Anywhere a name is accepted, a reference is accepted too: ``package.module:attr`` or
``path/to/file.py:attr``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar, cast, overload

from trellis.errors import (
    DuplicateComponentError,
    InvalidReferenceError,
    PluginLoadError,
    ProtocolMismatchError,
    UnknownComponentError,
)

T = TypeVar("T")


class ComponentProtocol(Protocol):
    """What a registry checks its components against (see :mod:`trellis.protocols`)."""

    @property
    def signature(self) -> str:
        """The expected shape, as shown in errors (e.g. ``fn(data, *, config)``)."""
        ...

    def problems(self, obj: Any) -> list[str]:
        """What keeps ``obj`` from fitting; an empty list means it fits."""
        ...


IN_PROCESS = "(in-process)"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Entry:
    """One name in a registry, as ``trellis plugins list`` shows it."""

    name: str
    group: str
    provider: str  # distribution name, or "(in-process)"
    version: str | None
    target: str  # "package.module:attr"
    loaded: bool


# ---------------------------------------------------------------- entry-point discovery

_index: dict[str, dict[str, list[metadata.EntryPoint]]] | None = None


def entry_points_of(group: str) -> dict[str, list[metadata.EntryPoint]]:
    """Entry points of ``group`` by name (several when distributions collide). Metadata only."""
    global _index
    if _index is None:
        # One pass over installed distributions for all groups: reading metadata once is what keeps
        # `trellis plugins list` fast. The standard library keeps the first of a distribution found twice
        # on sys.path, named by its metadata folder: the METADATA files of the ~150 distributions that
        # register nothing here are never parsed (that took 0.08 s).
        index: dict[str, dict[str, list[metadata.EntryPoint]]] = {}
        installed = metadata.entry_points()
        for name in sorted(g for g in installed.groups if g.startswith("trellis.")):
            for ep in installed.select(group=name):
                index.setdefault(ep.group, {}).setdefault(ep.name, []).append(ep)
        _index = index
    return _index.get(group, {})


def refresh_entry_points() -> None:
    """Forget the scanned metadata, e.g. after ``pip install``-ing a plugin into a live process."""
    global _index
    _index = None


def _provider(ep: metadata.EntryPoint) -> tuple[str, str | None]:
    dist = ep.dist
    return (dist.metadata["Name"], dist.version) if dist is not None else ("(unknown)", None)


def _describe_ep(ep: metadata.EntryPoint) -> str:
    name, version = _provider(ep)
    return f"distribution '{name} {version}' (entry point '{ep.name} = {ep.value}' in group '{ep.group}')"


# ---------------------------------------------------------------- references


def is_reference(text: str) -> bool:
    """True for ``package.module:attr`` and ``path/to/file.py:attr``, False for a plain name."""
    return ":" in text


def load_reference(ref: str) -> Any:
    """Import the object named by ``package.module:attr`` or ``path/to/file.py:attr``.

    ``attr`` may be dotted (``module:Class.method``). A file is imported once per absolute
    path; relative paths are relative to the current directory.

    Raises:
        InvalidReferenceError: malformed reference, missing file or missing attribute.
        PluginLoadError: the module or file raised while importing.
    """
    where, _, attr = ref.rpartition(":")
    if not where or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise InvalidReferenceError(
            f"Malformed reference {ref!r}: write 'package.module:attr' or 'path/to/file.py:attr'."
        )
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    try:
        module = _import_file(where) if is_file else importlib.import_module(where)
    except InvalidReferenceError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise InvalidReferenceError(
                f"Reference {ref!r}: no module named {exc.name!r}. Check the spelling, install the "
                f"package that provides it, or use a file reference like './my_file.py:{attr}'."
            ) from exc
        raise PluginLoadError(f"Reference {ref!r}: importing {where!r} failed: {exc!r}") from exc
    except Exception as exc:
        raise PluginLoadError(f"Reference {ref!r}: importing {where!r} failed: {exc!r}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise InvalidReferenceError(
                f"Reference {ref!r}: {where!r} has no attribute {part!r}"
                f"{_closest_hint(part, public)}. It defines: {', '.join(public) or '(nothing public)'}."
            )
        obj = getattr(obj, part)
    return obj


def _import_file(path: str) -> ModuleType:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise InvalidReferenceError(
            f"Reference file {path!r} does not exist (looked at {full!r}, current directory "
            f"{os.getcwd()!r}). Give a path relative to where you run trellis, or an absolute one."
        )
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    module_name = f"trellis_ref_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise InvalidReferenceError(
            f"Reference file {path!r} cannot be imported as a Python module ({full!r}); "
            "a file reference names a '.py' file."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec, so dataclasses and pickling can find it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _closest_hint(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


# ---------------------------------------------------------------- the registry


class Registry(Generic[T]):
    """Names -> components of one kind, bound to one entry-point group.

    Args:
        kind: what one component is called in messages, e.g. ``"advantage estimator"``.
        group: the entry-point group, e.g. ``"trellis.advantage_estimators"``.
        protocol: an object with ``problems(obj) -> list[str]`` and a ``signature`` string
            (see :mod:`trellis.protocols`); components that do not fit are rejected.
    """

    def __init__(self, kind: str, group: str, protocol: ComponentProtocol | None = None):
        self.kind = kind
        self.group = group
        self.protocol = protocol
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r}, names={self.names()})"

    # -- writing

    @overload
    def register(self, name: str, obj: None = None, *, replace: bool = False) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T, *, replace: bool = False) -> T: ...

    def register(self, name: str, obj: T | None = None, *, replace: bool = False) -> T | Callable[[T], T]:
        """Register ``obj`` under ``name`` in this process; usable as ``@registry.register(name)``.

        Raises:
            ValueError: ``name`` is not a valid name.
            DuplicateComponentError: ``name`` is taken and ``replace`` is False.
            ProtocolMismatchError: ``obj`` does not fit the registry's protocol.
        """
        if obj is None:

            def decorate(target: T) -> T:
                return self.register(name, target, replace=replace)

            return decorate
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"Invalid {self.kind} name {name!r}: use letters, digits, '_', '-' and '.', "
                "starting with a letter or digit (':' and '/' are reserved for references)."
            )
        if not replace and name in self:
            raise DuplicateComponentError(
                f"{self.kind.capitalize()} {name!r} is already registered by {self._who(name)}. "
                f"Pick another name, or pass replace=True to override it in this process."
            )
        self._check(name, obj, _target_of(obj))
        self._registered[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (entry points are untouched)."""
        self._registered.pop(name, None)

    # -- reading

    def get(self, name: str) -> T:
        """The component registered as ``name``, or the object a reference points at.

        Raises:
            UnknownComponentError: no such name; the message lists the names and the closest.
            PluginLoadError: the providing plugin failed to import.
            DuplicateComponentError: two distributions provide ``name``.
            ProtocolMismatchError: the component does not fit this registry's protocol.
        """
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        if isinstance(name, str) and is_reference(name):
            obj = load_reference(name)
            self._check(name, obj, name)
            return cast(T, obj)  # checked against the protocol just above
        candidates = entry_points_of(self.group).get(name)
        if not candidates:
            raise self._unknown(name)
        if len(candidates) > 1:
            providers = " and ".join(_describe_ep(ep) for ep in candidates)
            raise DuplicateComponentError(
                f"{self.kind.capitalize()} {name!r} is provided by more than one distribution: "
                f"{providers}. Uninstall one of them, or pick one in this process with "
                f"register({name!r}, <object>, replace=True)."
            )
        ep = candidates[0]
        try:
            obj = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"{self.kind.capitalize()} {name!r} could not be loaded from {_describe_ep(ep)}: "
                f"{type(exc).__name__}: {exc}. Other names still work; fix or uninstall "
                f"'{_provider(ep)[0]}'."
            ) from exc
        self._check(name, obj, f"{ep.value} from {_provider(ep)[0]}")
        component = cast(T, obj)  # checked against the protocol just above
        self._loaded[name] = component
        return component

    def names(self) -> list[str]:
        """All names, sorted, without importing anything."""
        return sorted(set(self._registered) | set(entry_points_of(self.group)))

    def entries(self) -> list[Entry]:
        """One :class:`Entry` per (name, provider), sorted by name; imports nothing."""
        rows: list[Entry] = []
        for name, obj in self._registered.items():
            rows.append(Entry(name, self.group, IN_PROCESS, None, _target_of(obj), True))
        for name, eps in entry_points_of(self.group).items():
            for ep in eps:
                dist, version = _provider(ep)
                loaded = name in self._loaded and name not in self._registered
                rows.append(Entry(name, self.group, dist, version, ep.value, loaded))
        return sorted(rows, key=lambda e: (e.name, e.provider))

    def __contains__(self, name: object) -> bool:
        return name in self._registered or name in entry_points_of(self.group)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    # -- helpers

    def _check(self, name: str, obj: Any, target: str) -> None:
        if self.protocol is None:
            return
        problems = self.protocol.problems(obj)
        if problems:
            raise ProtocolMismatchError(
                f"{self.kind.capitalize()} {name!r} ({target}) does not fit the {self.kind} protocol: "
                f"{'; '.join(problems)}. Expected {self.protocol.signature}."
            )

    def _who(self, name: str) -> str:
        if name in self._registered:
            return f"an in-process register() call ({_target_of(self._registered[name])})"
        return " and ".join(_describe_ep(ep) for ep in entry_points_of(self.group)[name])

    def _unknown(self, name: str) -> UnknownComponentError:
        available = self.names()
        closest = difflib.get_close_matches(name, available, n=1, cutoff=0.0)
        closest_name = closest[0] if closest else None
        listing = ", ".join(available) if available else f"none (no {self.kind} is installed)"
        hint = f" Closest match: {closest_name!r}." if closest_name else ""
        return UnknownComponentError(
            f"Unknown {self.kind} {name!r}. Available: {listing}.{hint} Install a plugin that "
            f"provides it (entry-point group '{self.group}'), register it in-process, or pass a "
            f"reference such as 'my_package.module:attr' or './my_file.py:attr'.",
            name=name,
            available=available,
            closest=closest_name,
        )


def _target_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{qualname}"

"""``BaseConfig``, the base of every config dataclass, and the checks its fields go through.

A config section is a plain (mutable) dataclass deriving from :class:`BaseConfig`. Each field
is declared with :func:`knob` (a default, a one-line doc and an optional range) or
:func:`section` (a nested dataclass). Constructing a section checks every field against its
annotation and range, then runs :meth:`BaseConfig.finalize`, where a section fills fields whose
``None`` means "derive it" and checks relations between fields. A bad value raises
:class:`ConfigValueError`, which names the dotted key, the value and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union

from trellis.errors import ConfigError

_RANGE_TEXT = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


class ConfigValueError(ConfigError):
    """A config value of the wrong type, outside its allowed set or range, or inconsistent with
    another value.

    ``key`` is the full dotted key (e.g. ``actor.optim.lr``), ``value`` the offending value.
    The message reads ``Config key '<key>' <requirement>; got <value>.<hint>``.
    """

    def __init__(self, key: str, value: Any, requirement: str, *, hint: str = "", prefix: str = ""):
        self.key = prefix + key
        self.value = value
        self._relative = (key, requirement, hint, prefix)
        # '{p}' in a requirement stands for the section prefix, so a section can name a sibling
        # ('must be <= {p}clip_ratio_high') and the message still shows the full dotted key.
        text = requirement.replace("{p}", prefix)
        got = repr(value)
        if requirement.startswith("must be a") or requirement.startswith("must be true"):
            got += f" ({type(value).__name__})"
        super().__init__(f"Config key '{self.key}' {text}; got {got}.{hint}")

    def under(self, path: str) -> ConfigValueError:
        """The same error for this section nested at dotted ``path`` (``""`` = unchanged)."""
        if not path:
            return self
        key, requirement, hint, prefix = self._relative
        return ConfigValueError(key, self.value, requirement, hint=hint, prefix=f"{path}.{prefix}")


# ---------------------------------------------------------------- declaring fields


def knob(
    default: Any,
    doc: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A config field: its ``default``, a one-line ``doc`` (what it is, its unit, why this default)
    and, for numbers, its valid range (``gt``/``ge``/``lt``/``le``; ``None`` values skip it).

    Mutable defaults (lists, dicts) are copied for each instance.
    """
    bounds = {
        name: bound for name, bound in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if bound is not None
    }
    metadata = {"doc": doc, "range": bounds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, doc: str, **overrides: Any) -> Any:
    """A nested config section: a fresh ``cls(**overrides)`` per instance, documented by ``doc``.

    ``overrides`` change the section's own defaults here (e.g. the critic's learning rate) and
    show in the defaults file.
    """
    return dataclasses.field(
        default_factory=functools.partial(cls, **overrides),
        metadata={"doc": doc, "section": (cls, overrides)},
    )


def default_dict(cls: type) -> dict[str, Any]:
    """The declared defaults of dataclass ``cls`` as nested plain containers.

    These are the values before :meth:`BaseConfig.finalize` fills derived fields: a ``None``
    that means "derive it" stays ``None``. A field without a default reads ``'???'`` (OmegaConf's
    "required" marker).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if "section" in f.metadata:
            sub_cls, overrides = f.metadata["section"]
            out[f.name] = {**default_dict(sub_cls), **copy.deepcopy(overrides)}
        elif f.default is not dataclasses.MISSING:
            out[f.name] = copy.deepcopy(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            out[f.name] = value
        else:
            out[f.name] = "???"
    return out


def field_doc(cls: type, name: str) -> str:
    """The one-line doc of field ``name`` of dataclass ``cls`` (``""`` when it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("doc", ""))
    return ""


def schema_default(cls: type, key: str) -> Any:
    """The declared default of ``key`` in config dataclass ``cls``: a field name, or a dotted path
    into nested sections (``schema_default(CriticConfig, "optim.lr")`` is 1e-05, the critic's own).

    Code that reads a setting from a config that may be None, a partial dict or a config object
    falls back to this, so a default is written once, in the schema. A section reads as a dict; a
    ``None`` that means "derive it" stays ``None`` (see :func:`default_dict`).

    Raises:
        KeyError: ``cls`` has no such key; the message lists the keys it has at that level.
    """
    node: Any = _declared_defaults(cls)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            keys = ", ".join(node) if isinstance(node, dict) else "(none: a value, not a section)"
            raise KeyError(f"{cls.__name__} has no key {key!r}; keys at {part!r}: {keys}.")
        node = node[part]
    return copy.deepcopy(node)


@functools.cache
def _declared_defaults(cls: type) -> dict[str, Any]:
    return default_dict(cls)  # never handed out: schema_default returns copies


# ---------------------------------------------------------------- type hints


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of dataclass ``cls``'s fields (``Any`` where one cannot be resolved)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a local class whose string annotations name local types
        return {f.name: (f.type if not isinstance(f.type, str) else Any) for f in dataclasses.fields(cls)}


def section_type(hint: Any) -> type | None:
    """The dataclass a field's annotation names (also through ``X | None``), else ``None``."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if _is_union(hint):
        for arm in typing.get_args(hint):
            if isinstance(arm, type) and dataclasses.is_dataclass(arm):
                return arm
    return None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


_NOUNS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def describe(hint: Any) -> str:
    """What a value of type ``hint`` looks like, for messages: ``an integer or null``."""
    if hint is Any:
        return "any value"
    if hint in _NOUNS:
        return _NOUNS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if _is_union(hint):
        arms = [describe(arm) for arm in args if arm is not type(None)]
        return " or ".join(arms) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"a list of {_PLURALS[args[0]]}" if args and args[0] in _PLURALS else "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a mapping (section {hint.__name__})"
    return f"a {getattr(hint, '__name__', hint)}"


def check_value(value: Any, hint: Any, key: str) -> Any:
    """``value`` if it fits annotation ``hint``, widened where needed (an int where a float is
    expected becomes a float).

    Raises:
        ConfigValueError: ``value`` does not fit; the message names ``key``.
    """
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint):
        if value is None and type(None) in args:
            return None
        arms = [arm for arm in args if arm is not type(None)]
        for arm in arms:
            try:
                return check_value(value, arm, key)
            except ConfigValueError as exc:
                last = exc
        if len(arms) == 1:  # keep the arm's precise message ("one of ..."), noting that null is allowed
            _, requirement, hint_text, _ = last._relative
            raise ConfigValueError(key, value, requirement + " or null", hint=hint_text)
        raise ConfigValueError(key, value, f"must be {describe(hint)}")
    if origin is Literal:
        if value in args and type(value) in {type(choice) for choice in args}:
            return value
        raise ConfigValueError(key, value, f"must be {describe(hint)}", hint=closest_hint(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list or hint is list:
        if isinstance(value, list):
            item = args[0] if args else Any
            return [check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            key_type, item = args if args else (Any, Any)
            for k in value:
                check_value(k, key_type, f"{key} (a key)")
            return {k: check_value(v, item, f"{key}.{k}") for k, v in value.items()}
    elif isinstance(hint, type):
        if isinstance(value, hint):
            return value
    else:  # an annotation we do not check (a Protocol, a TypeVar, ...)
        return value
    raise ConfigValueError(key, value, f"must be {describe(hint)}")


def check_range(value: Any, bounds: dict[str, float], key: str, shown: Any = None) -> None:
    """Raise :class:`ConfigValueError` when number ``value`` is outside ``bounds`` (``{"ge": 1}``);
    the message shows ``shown`` (the value as given, before widening) when given."""
    if not bounds or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    ok = all(
        {"gt": value > b, "ge": value >= b, "lt": value < b, "le": value <= b}[name]
        for name, b in bounds.items()
    )
    if not ok:
        text = " and ".join(f"{_RANGE_TEXT[name]} {_number(b)}" for name, b in bounds.items())
        raise ConfigValueError(key, value if shown is None else shown, f"must be {text}")


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def closest_hint(value: Any, choices: typing.Iterable[Any]) -> str:
    """`` Closest: 'x'.`` when a string ``value`` resembles one of ``choices``, else ``""``."""
    if not isinstance(value, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    squashed = {_squash(c): c for c in names}
    if _squash(value) in squashed:
        return f" Closest: {squashed[_squash(value)]!r}."
    match = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    return f" Closest: {match[0]!r}." if match else ""


def _squash(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def check_fields(obj: Any) -> None:
    """Check each field of dataclass instance ``obj`` against its annotation and range, widening
    ints to floats in place. Keys in errors are relative to ``obj``.

    Raises:
        ConfigValueError: the first field that does not fit.
    """
    cls: type = type(obj)  # type[Any] does not pass as Hashable to the cached type_hints
    hints = type_hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(value, hints.get(f.name, Any), f.name)
        if checked is not value:
            setattr(obj, f.name, checked)
        check_range(checked, f.metadata.get("range", {}), f.name, shown=value)


# ---------------------------------------------------------------- the base class


@dataclasses.dataclass
class BaseConfig:
    """Base of every Trellis config dataclass: checked fields and dict-like reading.

    ``cfg.get("optim.lr")``, ``cfg["ppo_epochs"]``, ``"clip_ratio" in cfg``, ``list(cfg)``,
    ``cfg.keys()`` / ``values()`` / ``items()`` and ``dict(cfg)`` all work; keys are field
    names (``get``, ``[]`` and ``in`` also take dotted paths into nested sections and dicts).

    Construction checks every field (see :func:`check_fields`) and then calls
    :meth:`finalize`. A subclass that defines ``__post_init__`` must call ``super().__post_init__()``.
    """

    def __post_init__(self) -> None:
        check_fields(self)
        self.finalize()

    def finalize(self) -> None:
        """Fill fields whose ``None`` means "derive it" and check relations between fields.

        Runs after every field has been type- and range-checked. Raise
        :class:`ConfigValueError` with a key relative to this section (write ``{p}`` before a
        sibling key named in the requirement, so it shows with the section's prefix).
        """

    # -- dict-like reading

    def get(self, key: str, default: Any = None) -> Any:
        """The value at ``key`` (a field name, or a dotted path such as ``"optim.lr"``), else ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def __getitem__(self, key: str) -> Any:
        node: Any = self
        for part in str(key).split("."):
            if dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}:
                node = getattr(node, part)
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise KeyError(f"{type(self).__name__} has no key {key!r}. Keys: {', '.join(self.keys())}.")
        return node

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def keys(self) -> list[str]:
        """The field names, in declaration order."""
        return [f.name for f in dataclasses.fields(self)]

    def values(self) -> list[Any]:
        """The field values, in declaration order (nested sections stay dataclasses)."""
        return [getattr(self, name) for name in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        """``(name, value)`` pairs, in declaration order."""
        return [(name, getattr(self, name)) for name in self.keys()]

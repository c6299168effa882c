"""Building configs: defaults < a YAML file < ``key=value`` overrides, resolved with OmegaConf.

``load_config`` merges the three layers, resolves ``${...}`` interpolations and returns a
checked :class:`TrellisConfig`. ``omega_conf_to_dataclass`` turns any mapping into a config
dataclass. Every problem is a :class:`~trellis.errors.ConfigError` that names the dotted key,
the value and, for a key that does not exist, the closest key that does.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from trellis.config.base import (
    BaseConfig,
    ConfigValueError,
    check_fields,
    default_dict,
    section_type,
    type_hints,
)
from trellis.config.render import render_yaml
from trellis.config.schema import TrellisConfig
from trellis.errors import ConfigError, InvalidReferenceError, PluginLoadError
from trellis.registry import load_reference

C = TypeVar("C")

TARGET_KEY = "_target_"
_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")

# Names other RL frameworks (verl) use for keys Trellis calls differently: suggested for unknown keys.
_ALIASES = {
    "strategy": "engine",
    "learning_rate": "lr",
    "ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_device",
    "log_prob_micro_batch_size_per_gpu": "log_prob_micro_batch_size_per_device",
    "ppo_max_token_len_per_gpu": "max_token_len_per_micro_batch",
    "n_gpus_per_node": "n_devices_per_node",
    "logger": "trackers",
    "default_local_dir": "run_dir",
    "param_offload": "param",
    "optimizer_offload": "optimizer",
    "enable_gradient_checkpointing": "gradient_checkpointing",
    "clip_grad": "grad_clip",
    "tensor_model_parallel_size": "tensor_parallel_size",
    "response_length": "max_tokens",
}


# ---------------------------------------------------------------- public API


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> TrellisConfig:
    """The run configuration: the defaults, merged with the YAML file at ``path`` (if given), merged
    with ``overrides`` (``"actor.optim.lr=1e-5"``, ``"data.train_files=[a.parquet,b.parquet]"``),
    later layers winning. ``${...}`` interpolations are resolved, derived ``null`` defaults filled
    and every value checked.

    An override may start with ``+`` (Hydra's "add a key"); it means the same as without. Keys
    inside free-form mappings (``rollout.engine_kwargs.<anything>``) may always be added.

    Raises:
        ConfigError: a missing or unreadable file, a YAML syntax error (file and line), a file
            whose top level is not a mapping, a malformed override, an unknown key (with the
            closest valid key), a wrong type, a value outside its set or range, or values that
            contradict each other.
    """
    merged = default_dict(TrellisConfig)
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((f"file '{os.fspath(path)}'", _read_yaml(path)))
    if isinstance(overrides, str):
        raise ConfigError(
            f"Overrides must be a list of 'key=value' strings, got one string {overrides!r}; "
            f"pass [{overrides!r}]."
        )
    layers.extend((f"override {item!r}", _parse_override(item)) for item in overrides)
    for source, data in layers:
        _check_keys(data, TrellisConfig, "", TrellisConfig, source)
        merged = _merge(merged, data)
    try:
        # OmegaConf resolves ${...} interpolations (and resolvers such as ${oc.env:HOME}).
        config = OmegaConf.create(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"The merged configuration is not valid: {_first_line(exc)}") from exc
    return omega_conf_to_dataclass(config, TrellisConfig)


def omega_conf_to_dataclass(config: Any, dataclass_type: type[C] | None = None) -> C:
    """Convert ``config`` (a ``DictConfig`` or a mapping) into an instance of a config dataclass.

    The class is ``dataclass_type``, or else the one ``config["_target_"]`` names:
    ``package.module:Class``, ``package.module.Class`` or ``./file.py:Class``. Interpolations are
    resolved; a mapping under a field annotated with a dataclass becomes that dataclass,
    recursively (a nested ``_target_`` may pick a subclass of it). Missing keys take the
    dataclass's defaults. A dataclass instance of the wanted type is returned as it is.

    Raises:
        ConfigError: an unknown key, a wrong type or an invalid value (keys are dotted paths
            relative to ``config``), a missing required key, or a ``_target_`` that cannot be
            imported or is not a dataclass.
        TypeError: ``dataclass_type`` is not a dataclass, or ``config`` is not a mapping.
    """
    if dataclass_type is not None and not (
        dataclasses.is_dataclass(dataclass_type) and isinstance(dataclass_type, type)
    ):
        raise TypeError(f"dataclass_type must be a dataclass type, got {dataclass_type!r}")
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        if dataclass_type is None or isinstance(config, dataclass_type):
            return config  # type: ignore[return-value]
        raise TypeError(f"Expected a mapping or a {dataclass_type.__name__}, got a {type(config).__name__}")
    data = _to_container(config)
    if not isinstance(data, dict):
        raise TypeError(f"Expected a DictConfig or a mapping, got {type(config).__name__}")
    cls = dataclass_type
    if cls is None:
        if TARGET_KEY not in data:
            raise ConfigError(
                f"Cannot tell which dataclass to build: pass dataclass_type, or add a '{TARGET_KEY}' key "
                "naming the class ('package.module:Class' or 'package.module.Class')."
            )
        cls = _resolve_target(data[TARGET_KEY], TARGET_KEY)
    return cast(C, _build(cls, data, "", cls))  # an instance of cls, which is dataclass_type when given


def to_dict(config: Any) -> dict[str, Any]:
    """``config`` (a config dataclass or a ``DictConfig``) as nested plain dicts and lists,
    interpolations resolved."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    data = _to_container(config)
    if not isinstance(data, dict):
        raise TypeError(f"Expected a config dataclass or a DictConfig, got {type(config).__name__}")
    return data


def to_yaml(config: Any, *, comments: bool = False) -> str:
    """``config`` (a config dataclass or a ``DictConfig``) as YAML that :func:`load_config` reads back.

    With ``comments``, each key of a dataclass is preceded by its doc, as in the defaults file.
    """
    cls = type(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else None
    return render_yaml(to_dict(config), cls, comments=comments)


# ---------------------------------------------------------------- reading the layers


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus exponent floats without a dot (``1e-6``, as YAML 1.2
    and OmegaConf's overrides read them) and an error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    shown = os.fspath(path)
    full = Path(path).expanduser()
    if not full.is_file():
        what = "is a directory, not a file" if full.is_dir() else "does not exist"
        raise ConfigError(
            f"Config file '{shown}' {what} (looked at '{full.absolute()}', "
            f"current directory '{os.getcwd()}')."
        )
    try:
        text = full.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Config file '{shown}' could not be read: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"YAML syntax error in config file '{shown}'{where}: {problem}.") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error in config file '{shown}': {exc}") from exc
    if data is None:  # an empty file (or only comments): nothing to override
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file '{shown}' must hold a mapping of sections (data:, model:, actor:, ...) at its top "
            f"level; it holds a {type(data).__name__}: {_short(data)}."
        )
    return data


def _parse_override(item: Any) -> dict[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(
            f"Override {item!r} is not of the form key=value (a dotted key, '=', a YAML value), "
            "e.g. 'actor.optim.lr=1e-5' or 'data.train_files=[a.parquet,b.parquet]'."
        )
    key, _, value = item.partition("=")
    key = key.strip().removeprefix("++").removeprefix("+")
    if not _OVERRIDE_KEY_RE.match(key):
        raise ConfigError(
            f"Override {item!r} has a malformed key {key!r}: write key=value with a dotted key such as "
            "'actor.optim.lr=1e-5'."
        )
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        if isinstance(exc, yaml.MarkedYAMLError):
            problem = " ".join(part for part in (exc.context, exc.problem) if part)
        else:
            problem = _first_line(exc)
        raise ConfigError(f"Override {item!r}: the value {value!r} is not valid YAML: {problem}.") from exc
    return parsed  # type: ignore[return-value]


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: mappings merge key by key; anything else (lists too) replaces.

    Unlike ``OmegaConf.merge``, a value of another kind replaces the old one (so the type check
    can name it) and ``'???'`` replaces a default (so a file can mark a key as required).
    """
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _to_container(config: Any) -> Any:
    if isinstance(config, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as exc:
            raise ConfigError(
                f"Config key '{exc.full_key}' is required but has no value ('???'); set it in the config "
                f"file or with an override {exc.full_key}=..."
            ) from exc
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None)
            raise ConfigError(
                f"Config key '{key}' could not be resolved: {_first_line(exc)}" if key else str(exc)
            ) from exc
    if isinstance(config, Mapping):
        try:
            node = OmegaConf.create(dict(config))
        except OmegaConfBaseException:  # values OmegaConf cannot hold: take them as they are
            return dict(config)
        return _to_container(node)
    return config


# ---------------------------------------------------------------- building dataclasses


def _build(cls: type, data: Any, path: str, root: type) -> Any:
    if not isinstance(data, dict):
        raise ConfigValueError(path or "<root>", data, f"must be a mapping (section {cls.__name__})")
    data = dict(data)
    if TARGET_KEY in data:
        target = _resolve_target(data.pop(TARGET_KEY), _join(path, TARGET_KEY))
        if not issubclass(target, cls):
            raise ConfigError(
                f"Config key '{_join(path, TARGET_KEY)}' names {target.__module__}.{target.__qualname__}, "
                f"which is not a subclass of {cls.__name__}, the type of '{path or '<root>'}'."
            )
        cls = target
    _check_keys(data, cls, path, root, None, recurse=False)
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                key = _join(path, f.name)
                raise ConfigError(f"Config key '{key}' is required; set it, e.g. with an override {key}=...")
            continue
        value = data[f.name]
        sub_cls = section_type(hints.get(f.name))
        if sub_cls is not None and isinstance(value, dict):
            value = _build(sub_cls, value, _join(path, f.name), root)
        kwargs[f.name] = value
    try:
        obj = cls(**kwargs)
        if not isinstance(obj, BaseConfig):  # a plain dataclass: still check its fields
            check_fields(obj)
    except ConfigValueError as exc:
        raise exc.under(path) from exc.__cause__
    return obj


def _resolve_target(target: Any, key: str) -> type:
    if not isinstance(target, str) or not target:
        raise ConfigValueError(key, target, "must be a string naming a class ('package.module:Class')")
    ref = target if ":" in target else ":".join(target.rsplit(".", 1))
    try:
        obj = load_reference(ref)
    except (InvalidReferenceError, PluginLoadError) as exc:
        raise ConfigError(f"Config key '{key}' names {target!r}, which could not be imported: {exc}") from exc
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise ConfigError(f"Config key '{key}' names {target!r}, which is not a dataclass: {obj!r}.")
    return obj


# ---------------------------------------------------------------- unknown keys


def _check_keys(
    data: dict[str, Any], cls: type, path: str, root: type, source: str | None, recurse: bool = True
) -> None:
    """Raise for the first key of ``data`` that ``cls`` has no field for (sections recursively).

    ``path`` is where ``data`` sits below ``root``; ``source`` (a file or an override) is named
    in the message.
    """
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    hints = type_hints(cls)
    for key, value in data.items():
        if key == TARGET_KEY:
            continue
        if key not in names:
            raise _unknown_key(_join(path, str(key)), value, cls, root, source)
        sub_cls = section_type(hints.get(key))
        if recurse and sub_cls is not None and isinstance(value, dict):
            _check_keys(value, sub_cls, _join(path, key), root, source)


def _unknown_key(key: str, value: Any, cls: type, root: type, source: str | None) -> ConfigError:
    parent, _, name = key.rpartition(".")
    closest = _closest_key(name, cls, parent, root)
    fields = ", ".join(f.name for f in dataclasses.fields(cls) if f.init)
    message = f"Unknown config key '{key}'."
    if closest:
        message += f" Closest valid key: '{closest}'."
    message += f" Keys of {repr(parent) if parent else 'the top level'}: {fields}."
    if source:
        message += f" It was set to {_short(value)} by {source}."
    return ConfigError(message)


def _closest_key(name: str, cls: type, parent: str, root: type) -> str | None:
    """The valid key most like ``name``, a key unknown to section ``cls`` at dotted ``parent``.

    In order: the same name (or its known rename, ignoring case, '_' and '-') inside ``cls``,
    then anywhere in ``root`` (a key put in the wrong section); a field of ``cls`` whose name is
    the initials of ``name`` ('learning_rate' -> 'lr'); the shortest field of ``cls`` holding all
    the words of ``name``; the most similar field of ``cls``.
    """
    target = _squash(_ALIASES.get(name, name))
    for scope, prefix in ((cls, parent), (root, "")):
        exact = [k for k in _all_keys(scope) if _squash(k.rpartition(".")[2]) == target]
        if exact:
            return _join(prefix, min(exact, key=lambda k: k.count(".")))
    siblings = [f.name for f in dataclasses.fields(cls) if f.init]
    initials = "".join(word[:1] for word in name.split("_"))
    if len(initials) > 1 and initials in siblings:
        return _join(parent, initials)
    words = set(name.lower().split("_"))  # 'total_steps' -> 'total_training_steps'
    wider = [sibling for sibling in siblings if words < set(sibling.split("_"))]
    if wider:
        return _join(parent, min(wider, key=len))
    match = difflib.get_close_matches(name, siblings, n=1, cutoff=0.0)
    return _join(parent, match[0]) if match else None


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys: list[str] = []
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        sub_cls = section_type(hints.get(f.name))
        if sub_cls is not None and sub_cls is not cls:
            keys.extend(_all_keys(sub_cls, f"{prefix}{f.name}."))
    return keys


# ---------------------------------------------------------------- helpers


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _squash(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

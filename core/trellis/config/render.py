"""Config dataclasses as YAML, each key under a comment with its doc.

``defaults/trellis.yaml`` is this module's rendering of ``TrellisConfig``'s declared defaults;
a test keeps the shipped file identical to it. After changing a default or a doc, regenerate::

    python -m trellis.config
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import yaml

from trellis.config.base import default_dict, section_type, type_hints
from trellis.config.schema import TrellisConfig

DEFAULTS_YAML = Path(__file__).parent / "defaults" / "trellis.yaml"
"""The shipped defaults file: every key of :class:`TrellisConfig` with its default and doc."""

WIDTH = 110
_HEADER = (
    "# Trellis defaults: every configuration key with its default value and what it means.\n"
    "# Generated from trellis/config/schema.py by `python -m trellis.config`; do not edit.\n"
    "# A run's own YAML file and key=value overrides are merged over these.\n"
)


def render_yaml(data: dict[str, Any], cls: type | None = None, *, comments: bool = True) -> str:
    """``data`` (nested plain containers) as block YAML, keys in order.

    With dataclass ``cls`` (the type ``data`` was made from) and ``comments``, each key is
    preceded by its field's doc, and top-level sections are separated by blank lines.
    """
    return "".join(_lines(data, cls if comments else None, indent=0))


def render_defaults_yaml() -> str:
    """The text of ``defaults/trellis.yaml``: the declared defaults of :class:`TrellisConfig`, documented."""
    return _HEADER + "\n" + render_yaml(default_dict(TrellisConfig), TrellisConfig)


def _lines(data: dict[str, Any], cls: type | None, indent: int) -> list[str]:
    pad = " " * indent
    docs = {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)} if cls else {}
    hints = type_hints(cls) if cls else {}
    out: list[str] = []
    for key, value in data.items():
        if cls is not None and indent == 0 and out:
            out.append("\n")
        if docs.get(key):
            width = max(40, WIDTH - indent - 2)
            out.extend(f"{pad}# {line}\n" for line in textwrap.wrap(docs[key], width, break_on_hyphens=False))
        sub_cls = section_type(hints.get(key)) if cls else None
        if isinstance(value, dict) and value and (sub_cls is not None or cls is None):
            out.append(f"{pad}{_scalar(key)}:\n")
            out.extend(_lines(value, sub_cls, indent + 2))
        else:
            out.append(f"{pad}{_scalar(key)}: {_scalar(value)}\n")
    return out


def _scalar(value: Any) -> str:
    """``value`` as one line of YAML (flow style for lists and mappings)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def main() -> None:
    """Rewrite ``defaults/trellis.yaml`` from the dataclasses."""
    DEFAULTS_YAML.write_text(render_defaults_yaml(), encoding="utf-8")
    print(f"wrote {DEFAULTS_YAML}")

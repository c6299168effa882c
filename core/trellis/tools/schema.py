"""The OpenAI function-tool schema and a tool's response, as validated dataclasses.

``from_dict`` raises ``SchemaError`` naming the offending field (``function.parameters.required[1]``);
``to_dict`` gives back plain JSON-ready dicts.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SchemaError(ValueError):
    """A tool schema or tool response is malformed; the message names the field."""


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SchemaError(f"{where} must be a mapping, got {type(value).__name__}: {value!r}")
    return value


def _no_extra(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise SchemaError(f"{where} has unknown field(s) {extra}; allowed: {sorted(allowed)}")


@dataclass
class OpenAIFunctionParameters:
    """A JSON-schema object: ``{"type": "object", "properties": {...}, "required": [...]}``."""

    properties: dict[str, dict[str, Any]] = field(default_factory=dict)
    required: list[str] = field(default_factory=list)
    type: str = "object"

    def __post_init__(self) -> None:
        where = "function.parameters"
        if self.type != "object":
            raise SchemaError(f"{where}.type must be 'object', got {self.type!r}")
        if not isinstance(self.properties, Mapping):
            raise SchemaError(f"{where}.properties must be a mapping, got {type(self.properties).__name__}")
        for key, spec in self.properties.items():
            if not isinstance(key, str) or not key:
                raise SchemaError(f"{where}.properties has a non-string or empty key {key!r}")
            if not isinstance(spec, Mapping):
                raise SchemaError(f"{where}.properties.{key} must be a mapping (a JSON schema), got {spec!r}")
        if not isinstance(self.required, (list, tuple)):
            raise SchemaError(f"{where}.required must be a list of names, got {self.required!r}")
        for i, name in enumerate(self.required):
            if name not in self.properties:
                raise SchemaError(
                    f"{where}.required[{i}] {name!r} is not in properties ({sorted(self.properties)})"
                )
        self.properties = {k: copy.deepcopy(dict(v)) for k, v in self.properties.items()}
        self.required = list(self.required)

    @classmethod
    def from_dict(cls, data: Any) -> OpenAIFunctionParameters:
        data = _mapping(data, "function.parameters")
        _no_extra(data, {"type", "properties", "required", "additionalProperties"}, "function.parameters")
        return cls(
            type=data.get("type", "object"),
            properties=data.get("properties", {}),
            required=data.get("required", []),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "properties": copy.deepcopy(self.properties),
            "required": list(self.required),
        }


@dataclass
class OpenAIFunctionSchema:
    """``{"name", "description", "parameters"}`` of one function tool."""

    name: str
    description: str = ""
    parameters: OpenAIFunctionParameters = field(default_factory=OpenAIFunctionParameters)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SchemaError(
                f"function.name must be 1-64 characters of letters, digits, '_' or '-', got {self.name!r}"
            )
        if not isinstance(self.description, str):
            raise SchemaError(f"function.description must be a string, got {self.description!r}")
        if isinstance(self.parameters, Mapping):
            self.parameters = OpenAIFunctionParameters.from_dict(self.parameters)
        if not isinstance(self.parameters, OpenAIFunctionParameters):
            raise SchemaError(f"function.parameters must be a mapping, got {self.parameters!r}")

    @classmethod
    def from_dict(cls, data: Any) -> OpenAIFunctionSchema:
        data = _mapping(data, "function")
        _no_extra(data, {"name", "description", "parameters", "strict"}, "function")
        if "name" not in data:
            raise SchemaError("function.name is missing")
        return cls(
            name=data["name"],
            description=data.get("description", ""),
            parameters=OpenAIFunctionParameters.from_dict(data.get("parameters", {})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters.to_dict()}


@dataclass
class OpenAIFunctionToolSchema:
    """``{"type": "function", "function": {...}}`` as sent to the model's chat template."""

    function: OpenAIFunctionSchema
    type: str = "function"

    def __post_init__(self) -> None:
        if self.type != "function":
            raise SchemaError(f"type must be 'function', got {self.type!r}")
        if isinstance(self.function, Mapping):
            self.function = OpenAIFunctionSchema.from_dict(self.function)
        if not isinstance(self.function, OpenAIFunctionSchema):
            raise SchemaError(f"function must be a mapping, got {self.function!r}")

    @property
    def name(self) -> str:
        return self.function.name

    @classmethod
    def from_dict(cls, data: Any) -> OpenAIFunctionToolSchema:
        """Validate ``data``. Raises ``SchemaError`` naming the bad field."""
        data = _mapping(data, "tool schema")
        _no_extra(data, {"type", "function"}, "tool schema")
        if "function" not in data:
            raise SchemaError("tool schema has no 'function' field")
        return cls(
            type=data.get("type", "function"), function=OpenAIFunctionSchema.from_dict(data["function"])
        )

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "function": self.function.to_dict()}


@dataclass
class ToolResponse:
    """What a tool hands back to the model: text and/or images (both optional)."""

    text: str | None = None
    image: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.text is not None and not isinstance(self.text, str):
            raise SchemaError(f"ToolResponse.text must be a string or None, got {type(self.text).__name__}")
        if self.image is not None and not isinstance(self.image, list):
            raise SchemaError(f"ToolResponse.image must be a list or None, got {type(self.image).__name__}")

    @classmethod
    def from_dict(cls, data: Any) -> ToolResponse:
        data = _mapping(data, "ToolResponse")
        _no_extra(data, {"text", "image"}, "ToolResponse")
        return cls(text=data.get("text"), image=data.get("image"))

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "image": self.image}

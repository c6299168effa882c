"""trellis.tools.schema: validated tool schema and tool response dataclasses."""

from __future__ import annotations

import pytest

from trellis.tools import OpenAIFunctionToolSchema, SchemaError, ToolResponse

GOOD = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            "required": ["query"],
        },
    },
}


def test_round_trip():
    schema = OpenAIFunctionToolSchema.from_dict(GOOD)
    assert schema.name == "search"
    assert schema.function.parameters.required == ["query"]
    assert schema.to_dict() == GOOD
    assert OpenAIFunctionToolSchema.from_dict(schema.to_dict()) == schema


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"type": "tool"}, r"^type must be 'function', got 'tool'"),
        ({"function": None}, r"^function must be a mapping, got NoneType"),
        ({"function": {"description": "x"}}, r"^function\.name is missing"),
        ({"function": {"name": "has space"}}, r"^function\.name must be 1-64 characters.*'has space'"),
        ({"function": {"name": "f", "description": 3}}, r"^function\.description must be a string, got 3"),
        (
            {"function": {"name": "f", "parameters": {"type": "array"}}},
            r"function\.parameters\.type must be 'object'",
        ),
        (
            {"function": {"name": "f", "parameters": {"properties": {"a": {}}, "required": ["a", "b"]}}},
            r"function\.parameters\.required\[1\] 'b' is not in properties \(\['a'\]\)",
        ),
        (
            {"function": {"name": "f", "parameters": {"properties": {"a": 1}}}},
            r"properties\.a must be a mapping",
        ),
        ({"function": {"name": "f", "nmae": 1}}, r"function has unknown field\(s\) \['nmae'\]"),
        ({"extra": 1}, r"tool schema has unknown field\(s\) \['extra'\]"),
    ],
)
def test_errors_name_the_bad_field(patch, message):
    data = {**GOOD, **patch}
    with pytest.raises(SchemaError, match=message):
        OpenAIFunctionToolSchema.from_dict(data)


def test_not_a_mapping():
    with pytest.raises(SchemaError, match=r"tool schema must be a mapping, got list"):
        OpenAIFunctionToolSchema.from_dict([])


def test_tool_response():
    assert ToolResponse.from_dict({"text": "hi"}).to_dict() == {"text": "hi", "image": None}
    assert ToolResponse().to_dict() == {"text": None, "image": None}
    with pytest.raises(SchemaError, match=r"ToolResponse\.text must be a string or None, got int"):
        ToolResponse.from_dict({"text": 5})
    with pytest.raises(SchemaError, match=r"ToolResponse\.image must be a list or None, got str"):
        ToolResponse(image="x.png")
    with pytest.raises(SchemaError, match=r"ToolResponse has unknown field\(s\) \['txt'\]"):
        ToolResponse.from_dict({"txt": "hi"})

"""Tool-call parsers: read the tool calls out of a model's text.

Parsers are named components of the registry :data:`tool_parsers` (entry-point group
``trellis.tool_parsers``), chosen with ``rollout.agent.tool_parser``. A parser is a class with
``extract_tool_calls(text) -> (content, calls)``; the core registers ``hermes``, the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format of Hermes, Qwen 2.5 / 3 and
SmolLM models. A plugin adds its own format the usual way::

    [project.entry-points."trellis.tool_parsers"]
    my_format = "my_pkg.parsers:MyParser"
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass
from typing import Any

from trellis.protocols import ClassProtocol
from trellis.registry import Registry


@dataclass(frozen=True)
class FunctionCall:
    """One tool call found in the text.

    Attributes:
        name: the function the model asked for ("" when the call could not be read).
        arguments: its arguments as a dict (empty when unreadable).
        error: why the call could not be read, or None. The agent loop tells the model.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None


class ToolParser(abc.ABC):
    """Base of tool-call parsers. Parsers keep no per-call state, so one instance serves every loop."""

    @abc.abstractmethod
    def extract_tool_calls(self, text: str) -> tuple[str, list[FunctionCall]]:
        """``(content, calls)``: the text outside the calls, and the calls in order of appearance.

        A malformed call is returned with ``error`` set rather than raised or dropped, so the model can
        be told what went wrong.
        """

    def call_prefix(self, name: str | None) -> str | None:
        """The text that opens a call in this format, to any function (``name`` None) or to ``name``;
        None: the format cannot be opened that way. The gateway writes it after the generation prompt
        for ``tool_choice: required`` or a named function, so the model's reply starts inside a call
        (the opening is prompt, not policy output: it is never trained on). The default: None."""
        return None


tool_parsers: Registry[type] = Registry(
    "tool parser",
    "trellis.tool_parsers",
    ClassProtocol("a ToolParser class with extract_tool_calls(text)", methods=("extract_tool_calls",)),
)


def get_tool_parser(name: str) -> ToolParser:
    """An instance of the parser registered as ``name`` (or a ``module:Class`` reference)."""
    return tool_parsers.get(name)()


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>``.

    ``arguments`` may also be a JSON string holding the object (some models emit that). A block that
    is not JSON, not an object, or lacks a string ``name`` becomes a call with ``error`` set. An
    unclosed ``<tool_call>`` at the end (the response ran out of tokens) is not a call.
    """

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def call_prefix(self, name: str | None) -> str:
        """``<tool_call>{"name": "`` (any function), or ``<tool_call>{"name": "<name>", "arguments":``.

        Each ends where a tokenizer cuts anyway (inside the JSON, before a quoted word or the space a
        tokenizer attaches to the next token), so the model continues from the tokens it would have
        written itself; ``<tool_call>`` alone ends mid-token for a tokenizer that merges ``>{`` and
        leaves the model lost. No newline follows ``<tool_call>``, which the JSON does not need.
        """
        if name is None:
            return '<tool_call>{"name": "'
        return "<tool_call>" + '{"name": ' + json.dumps(name) + ', "arguments":'

    def extract_tool_calls(self, text: str) -> tuple[str, list[FunctionCall]]:
        calls = [self._parse(m.group(1)) for m in self._BLOCK.finditer(text)]
        content = self._BLOCK.sub("", text).strip()
        return content, calls

    @staticmethod
    def _parse(body: str) -> FunctionCall:
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return FunctionCall("", {}, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(data, dict):
            return FunctionCall("", {}, f"the tool call must be a JSON object, got {type(data).__name__}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            return FunctionCall("", {}, 'the tool call has no "name" string')
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return FunctionCall(name, {}, f'the "arguments" of {name} are not a JSON object')
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return FunctionCall(name, {}, f'the "arguments" of {name} must be a JSON object')
        return FunctionCall(name, arguments)

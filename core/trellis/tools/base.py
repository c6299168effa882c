"""The tool protocol (``BaseTool``), the fault-proof runner (``call_tool``) and ``load_tools``.

A tool keeps per-trajectory state keyed by an instance id: ``create`` opens it, ``execute`` runs one
call, ``calc_reward`` scores the trajectory, ``release`` forgets it. Tools are built from config::

    tools:
      - name: calculator                      # a registry name ...
        config: {rate_limit: {rate: 10, max_concurrent: 4}}
      - name: my_pkg.tools:SearchTool         # ... or a module:Class reference
        config: {...}
        schema: {type: function, function: {name: search, ...}}   # optional
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from trellis.tools.rate_limit import ToolLimits
from trellis.tools.schema import OpenAIFunctionToolSchema, SchemaError, ToolResponse


class ToolConfigError(ValueError):
    """A tools config entry is malformed; the message names the entry."""


class BaseTool:
    """A tool the model can call. Subclasses set ``default_schema`` and override ``execute``.

    Args:
        config: the tool's settings; ``rate_limit: {rate, capacity, max_concurrent}`` is read here.
        tool_schema: the schema shown to the model; ``None`` uses the class's ``default_schema``.
    """

    default_schema: ClassVar[dict[str, Any] | None] = None

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | dict | None = None,
    ) -> None:
        self.config: dict[str, Any] = dict(config or {})
        if tool_schema is None:
            tool_schema = type(self).default_schema
        if tool_schema is None:
            raise SchemaError(f"{type(self).__name__} has no default_schema; pass tool_schema explicitly")
        if not isinstance(tool_schema, OpenAIFunctionToolSchema):
            tool_schema = OpenAIFunctionToolSchema.from_dict(tool_schema)
        self.tool_schema = tool_schema
        self.limits = ToolLimits.from_config(self.config.get("rate_limit"))
        self._instances: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        return self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    def state(self, instance_id: str) -> dict[str, Any]:
        """The per-instance state dict. Raises ``KeyError`` for an id never created or already released."""
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(f"{self.name}: unknown instance {instance_id!r}; call create() first") from None

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Open an instance (a fresh uuid when ``instance_id`` is None); ``kwargs`` go into its state."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        if instance_id in self._instances:
            raise ValueError(f"{self.name}: instance {instance_id!r} already exists; release it first")
        self._instances[instance_id] = dict(kwargs)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one call. Returns ``(response, step_reward, metrics)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute()")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory-level reward of this instance (0.0 unless overridden)."""
        self.state(instance_id)
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance; releasing an unknown id is a no-op."""
        self._instances.pop(instance_id, None)


def _error(message: str, metrics: dict[str, float]) -> tuple[ToolResponse, float, dict[str, float]]:
    return ToolResponse(text=f"Error: {message}"), 0.0, metrics


def _retrieve(task: asyncio.Task[Any]) -> None:
    # A timed-out call keeps running until it honours cancellation; swallow what it ends with.
    if not task.cancelled():
        task.exception()


async def call_tool(
    tool: Any, instance_id: str, parameters: Any, *, timeout: float | None = None, **kwargs: Any
) -> tuple[ToolResponse, float, dict[str, Any]]:
    """Run ``tool.execute`` under the tool's limits and ``timeout`` seconds; never raises for tool faults.

    A tool that raises, runs past ``timeout`` or returns something other than
    ``(ToolResponse | dict, real number, dict)`` gives an ``Error: ...`` response for the model and
    step reward 0.0. Metrics always hold ``tool/errors``, ``tool/timeouts``, ``tool/bad_output``
    (0 or 1) and ``tool/latency_s``, plus the tool's own metrics on success. A timed-out call is
    cancelled but not awaited, so a tool that ignores cancellation cannot hang the rollout.
    Cancelling ``call_tool`` itself propagates.
    """
    metrics: dict[str, Any] = {"tool/errors": 0, "tool/timeouts": 0, "tool/bad_output": 0}
    name = getattr(tool, "name", type(tool).__name__)
    start = time.monotonic()

    def done(**flags: int) -> dict[str, Any]:
        metrics.update(flags)
        metrics["tool/latency_s"] = time.monotonic() - start
        return metrics

    if not isinstance(parameters, Mapping):
        return _error(
            f"{name} expects a JSON object of arguments, got {parameters!r:.200}", done(**{"tool/errors": 1})
        )
    limits = getattr(tool, "limits", None)
    slot = limits.slot() if isinstance(limits, ToolLimits) else _null_slot()
    async with slot:
        start = time.monotonic()
        task = asyncio.ensure_future(tool.execute(instance_id, dict(parameters), **kwargs))
        try:
            finished, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        if not finished:
            task.cancel()
            task.add_done_callback(_retrieve)
            return _error(f"{name} timed out after {timeout:g} s", done(**{"tool/timeouts": 1}))
    exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
    if exc is not None:
        return _error(f"{name} failed: {type(exc).__name__}: {exc}", done(**{"tool/errors": 1}))
    result = task.result()
    bad = _check_output(result)
    if bad:
        return _error(f"{name} returned an invalid result ({bad})", done(**{"tool/bad_output": 1}))
    response, reward, tool_metrics = result
    if isinstance(response, Mapping):
        response = ToolResponse.from_dict(response)
    metrics.update(tool_metrics)
    return response, float(reward), done()


class _null_slot:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _check_output(result: Any) -> str | None:
    """Why ``result`` is not ``(response, reward, metrics)``, or None when it is."""
    if not isinstance(result, tuple) or len(result) != 3:
        return f"expected a (response, reward, metrics) tuple, got {type(result).__name__}"
    response, reward, metrics = result
    if isinstance(response, Mapping):
        try:
            ToolResponse.from_dict(response)
        except SchemaError as exc:
            return str(exc)
    elif not isinstance(response, ToolResponse):
        return f"response must be a ToolResponse, got {type(response).__name__}"
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return f"step reward must be a finite number, got {reward!r:.100}"
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        return f"metrics must be a dict with string keys, got {type(metrics).__name__}"
    return None


def load_tools(config_list: Sequence[Mapping[str, Any]] | None) -> dict[str, BaseTool]:
    """Build the tools a config lists: ``[{name, config?, schema?}, ...]`` -> ``{tool.name: tool}``.

    ``name`` is a registry name (``calculator``) or a ``module:Class`` reference; the tool's name in the
    result is its schema's function name (the class default when ``schema`` is absent).

    Raises:
        ToolConfigError: an entry is not a mapping, lacks ``name``, has unknown keys, or two tools share
            a name. Registry errors (unknown name, protocol mismatch) and ``SchemaError`` pass through.
    """
    from trellis.registries import tools as registry

    result: dict[str, BaseTool] = {}
    for i, item in enumerate(config_list or []):
        where = f"tools[{i}]"
        if not isinstance(item, Mapping):
            raise ToolConfigError(f"{where} must be a mapping with name/config/schema, got {item!r}")
        extra = sorted(set(item) - {"name", "config", "schema"})
        if extra:
            raise ToolConfigError(f"{where} has unknown key(s) {extra}; allowed: name, config, schema")
        ref = item.get("name")
        if not isinstance(ref, str) or not ref:
            raise ToolConfigError(f"{where}.name must be a registry name or module:Class, got {ref!r}")
        config = _plain(item.get("config") or {})
        schema = item.get("schema")
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config must be a mapping, got {config!r}")
        cls = registry.get(ref)
        tool = cls(config, _plain(schema) if schema is not None else None)
        if tool.name in result:
            raise ToolConfigError(
                f"{where}: a tool named {tool.name!r} is already configured; names must be unique"
            )
        result[tool.name] = tool
    return result


def _plain(value: Any) -> Any:
    """Plain dicts/lists from OmegaConf containers or other mappings/sequences."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    ):
        return [_plain(v) for v in value]
    return value

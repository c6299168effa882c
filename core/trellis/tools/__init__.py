"""Tools an agent calls during multi-turn rollouts (registry ``trellis.tools``).

``BaseTool`` is the protocol; ``call_tool`` runs one call so that no tool fault reaches the rollout;
``load_tools`` builds the tools a YAML config lists. Built-ins: ``calculator``, ``python``, ``gsm8k``.
"""

from trellis.tools.base import BaseTool, ToolConfigError, call_tool, load_tools
from trellis.tools.rate_limit import AsyncTokenBucket, ConcurrencyLimit, ToolLimits
from trellis.tools.schema import OpenAIFunctionToolSchema, SchemaError, ToolResponse

__all__ = [
    "AsyncTokenBucket",
    "BaseTool",
    "ConcurrencyLimit",
    "OpenAIFunctionToolSchema",
    "SchemaError",
    "ToolConfigError",
    "ToolLimits",
    "ToolResponse",
    "call_tool",
    "load_tools",
]

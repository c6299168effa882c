"""Rollout: the replica protocol every generation backend implements, the built-in ``hf`` replica,
and the agent loops that turn prompts into (possibly multi-turn, tool-using) responses.

from trellis.rollout import RolloutReplica, SamplingParams, TokenOutput, AgentLoop, AgentLoopManager
"""

from trellis.rollout.base import MODES, RolloutReplica
from trellis.rollout.sampling import SamplingParams, TokenOutput
from trellis.utils.lazy import lazy_attributes

_LAZY = {
    "AgentLoop": "trellis.rollout.agent_loop:AgentLoop",
    "AgentLoopManager": "trellis.rollout.agent_loop:AgentLoopManager",
    "AgentLoopOutput": "trellis.rollout.agent_loop:AgentLoopOutput",
    "ReplicaSession": "trellis.rollout.agent_loop:ReplicaSession",
    "ChatTemplate": "trellis.rollout.chat:ChatTemplate",
    "ToolParser": "trellis.rollout.tool_parser:ToolParser",
    "FunctionCall": "trellis.rollout.tool_parser:FunctionCall",
    "get_tool_parser": "trellis.rollout.tool_parser:get_tool_parser",
}

__all__ = ["MODES", "RolloutReplica", "SamplingParams", "TokenOutput", *_LAZY]

__getattr__, __dir__ = lazy_attributes("trellis.rollout", _LAZY, globals())

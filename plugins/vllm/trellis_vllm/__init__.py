"""trellis-vllm: the ``vllm`` rollout replica (``rollout.name=vllm``).

Importing this package does not import vLLM; the engine is imported when a replica starts.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["VLLMRolloutReplica"]


def __getattr__(name: str):  # lazy, so `import trellis_vllm` stays cheap
    if name == "VLLMRolloutReplica":
        from trellis_vllm.replica import VLLMRolloutReplica

        return VLLMRolloutReplica
    raise AttributeError(f"module 'trellis_vllm' has no attribute {name!r}")

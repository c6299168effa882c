"""Rollout replicas: the protocol every generation backend implements, and the built-in ``hf`` one.

from trellis.rollout import RolloutReplica, SamplingParams, TokenOutput
"""

from trellis.rollout.base import MODES, RolloutReplica
from trellis.rollout.sampling import SamplingParams, TokenOutput

__all__ = ["MODES", "RolloutReplica", "SamplingParams", "TokenOutput"]

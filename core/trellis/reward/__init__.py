"""Rewards: built-in scoring functions, how a configured function is resolved, and the managers that
turn a batch of responses into token-level scores.

Importing this package is cheap (no torch); the managers import on first access.
"""

from __future__ import annotations

from trellis.reward.builtin import (
    DATA_SOURCES,
    UnknownDataSourceError,
    arithmetic_score,
    default_compute_score,
    exact_match_score,
    format_score,
    geo3k_score,
    gsm8k_lenient_score,
    gsm8k_score,
    judge_score,
    math_dapo_score,
    math_lenient_score,
    math_score,
    search_r1_score,
)
from trellis.reward.resolve import resolve_reward_function
from trellis.utils.lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "NaiveRewardManager": "trellis.reward.managers:NaiveRewardManager",
    "BatchRewardManager": "trellis.reward.managers:BatchRewardManager",
    "AsyncRewardManager": "trellis.reward.managers:AsyncRewardManager",
    "ModelRewardManager": "trellis.reward.model:ModelRewardManager",
}

__all__ = [
    "DATA_SOURCES",
    "UnknownDataSourceError",
    "arithmetic_score",
    "default_compute_score",
    "exact_match_score",
    "format_score",
    "geo3k_score",
    "gsm8k_lenient_score",
    "gsm8k_score",
    "judge_score",
    "math_dapo_score",
    "math_lenient_score",
    "math_score",
    "search_r1_score",
    "resolve_reward_function",
    *_LAZY,
]

__getattr__, __dir__ = lazy_attributes("trellis.reward", _LAZY, globals())

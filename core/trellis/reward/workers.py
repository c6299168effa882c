"""What the async reward manager's worker processes run.

Kept apart from ``managers`` so that a worker imports neither torch nor the data layer: each
fresh process (after a timeout kills the pool) then starts in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trellis.reward.resolve import resolve_reward_function


def _worker_function(payload: Any) -> Callable[..., Any]:
    if isinstance(payload, tuple):  # (name, reference or None; kwargs): resolved in the worker
        spec, kwargs = payload
        return resolve_reward_function(spec, **kwargs)
    return payload


def warm_up(payload: Any) -> None:
    """Load the scoring function, so that the first timed call does not pay for imports."""
    _worker_function(payload)


def worker_score(payload: Any, sample: dict[str, Any]) -> Any:
    """Score one sample (a dict of the reward-function keywords) in a worker process."""
    return _worker_function(payload)(**sample)

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


_memory_limit: int | None = None


def set_memory_limit(limit_bytes: int | None) -> None:
    """Pool initializer: this process may grow by ``limit_bytes`` once :func:`warm_up` loaded the function."""
    global _memory_limit
    _memory_limit = limit_bytes


def warm_up(payload: Any) -> None:
    """Load the scoring function, so that the first timed call does not pay for imports; then cap the
    process's data memory (``RLIMIT_DATA``: heap and private mappings) at what it uses now plus
    :func:`set_memory_limit`'s allowance, so a call that balloons gets a ``MemoryError``."""
    _worker_function(payload)
    if _memory_limit is not None:
        import resource

        limit = _data_bytes() + _memory_limit
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _data_bytes() -> int:
    """This process's data memory now (``VmData``), in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_score(payload: Any, sample: dict[str, Any]) -> Any:
    """Score one sample (a dict of the reward-function keywords) in a worker process."""
    return _worker_function(payload)(**sample)

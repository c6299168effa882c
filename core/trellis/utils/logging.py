"""Rank-aware printing and logging for code that runs in every process of a job."""

from __future__ import annotations

import logging
import os
import sys


def get_rank() -> int:
    """This process's rank: torch.distributed's when a process group is initialised, else ``$RANK``, else 0.

    torch is not imported here: a process that has not imported it has no process group.

    Raises:
        ValueError: ``$RANK`` is set but is not an integer.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "").strip()
    if not value:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable RANK={value!r} is not an integer; fix or unset it.") from None


def print_rank_0(message: object) -> None:
    """``print(message)`` on rank 0 only (see :func:`get_rank`); other ranks print nothing."""
    if get_rank() == 0:
        print(message, flush=True)


def log_with_rank(
    message: object,
    rank: int,
    logger: logging.Logger,
    level: int = logging.INFO,
    log_only_rank_0: bool = False,
) -> None:
    """Log ``"[Rank {rank}] {message}"`` on ``logger`` at ``level``.

    With ``log_only_rank_0``, nothing is logged unless ``rank`` is 0.
    """
    if log_only_rank_0 and rank != 0:
        return
    logger.log(level, "[Rank %d] %s", rank, message)

"""Running a coroutine from synchronous code, whether or not this thread already runs an event loop.

Several layers need it (reward managers, agent loops, worker groups: a synchronous entry point over
an async implementation), so it lives at the bottom, in ``trellis.utils``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result (or raise its exception).

    ``asyncio.run`` refuses to start inside a running loop (an async trainer calling a synchronous
    method), so there the coroutine runs on a fresh loop in a helper thread, and this thread blocks
    until it ends.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:
        # outside the except block: an exception raised in the coroutine (a task's CancelledError kept
        # by a future) would otherwise chain to the RuntimeError above, whose traceback holds every
        # caller's frame, and keep the caller's batch alive until the next call
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        return helper.submit(asyncio.run, coro).result()

"""Per-tool rate and concurrency limits: a FIFO-fair async token bucket and a concurrency cap.

A tool reads ``rate_limit: {rate, capacity, max_concurrent}`` from its config into ``ToolLimits``;
``call_tool`` holds ``limits.slot()`` around each call. Every tool instance has its own limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Refill arithmetic is float; accept a shortfall this small rather than sleep for ~0 seconds.
_EPS = 1e-9


class AsyncTokenBucket:
    """A token bucket: ``capacity`` tokens, refilled continuously at ``rate`` tokens per second.

    ``acquire(n)`` waits until ``n`` tokens are available and takes them. Waiters are served strictly
    in arrival order (an ``asyncio.Lock`` is FIFO), so a large request is never starved by a stream of
    small ones; the bucket never goes negative. ``clock`` and ``sleep`` are injectable for tests.
    """

    def __init__(
        self,
        rate: float,
        capacity: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a positive number of tokens per second, got {rate!r}")
        if not (isinstance(capacity, (int, float)) and math.isfinite(capacity) and capacity >= 1):
            raise ValueError(f"capacity must be a number >= 1, got {capacity!r}")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.capacity
        self._last = clock()
        self._lock = asyncio.Lock()

    @property
    def tokens(self) -> float:
        """Tokens available now (refilled up to the current clock)."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last)  # a clock going backwards adds nothing
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._last = now

    async def acquire(self, n: float = 1) -> None:
        """Take ``n`` tokens, waiting (FIFO) until they are there.

        Raises:
            ValueError: ``n`` is not positive or exceeds ``capacity`` (it could never be served).
        """
        if not (isinstance(n, (int, float)) and n > 0):
            raise ValueError(f"n must be a positive number of tokens, got {n!r}")
        if n > self.capacity:
            raise ValueError(f"cannot acquire {n} tokens from a bucket of capacity {self.capacity:g}")
        async with self._lock:
            while True:
                self._refill()
                if self._tokens >= n - _EPS:
                    self._tokens = max(0.0, self._tokens - n)
                    return
                await self._sleep((n - self._tokens) / self.rate)


class ConcurrencyLimit:
    """At most ``max_concurrent`` holders at a time: ``async with limit: ...``."""

    def __init__(self, max_concurrent: int) -> None:
        if not isinstance(max_concurrent, int) or isinstance(max_concurrent, bool) or max_concurrent < 1:
            raise ValueError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        self.max_concurrent = max_concurrent
        self.in_use = 0
        self._sem = asyncio.Semaphore(max_concurrent)

    async def __aenter__(self) -> ConcurrencyLimit:
        await self._sem.acquire()
        self.in_use += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.in_use -= 1
        self._sem.release()


@dataclass
class ToolLimits:
    """One tool's limits; ``None`` means unlimited. ``capacity`` defaults to ``max(1, rate)``."""

    rate: float | None = None
    capacity: float | None = None
    max_concurrent: int | None = None
    bucket: AsyncTokenBucket | None = field(default=None, init=False, repr=False)
    concurrency: ConcurrencyLimit | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity is not None and self.rate is None:
            raise ValueError("rate_limit.capacity was given without rate_limit.rate")
        if self.rate is not None:
            capacity = self.capacity if self.capacity is not None else max(1.0, float(self.rate))
            self.bucket = AsyncTokenBucket(self.rate, capacity)
        if self.max_concurrent is not None:
            self.concurrency = ConcurrencyLimit(self.max_concurrent)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> ToolLimits:
        """From a tool config's ``rate_limit`` section (``None`` or ``{}``: unlimited)."""
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise ValueError(
                f"rate_limit must be a mapping with rate/capacity/max_concurrent, got {config!r}"
            )
        extra = sorted(set(config) - {"rate", "capacity", "max_concurrent"})
        if extra:
            raise ValueError(
                f"rate_limit has unknown key(s) {extra}; allowed: rate, capacity, max_concurrent"
            )
        return cls(config.get("rate"), config.get("capacity"), config.get("max_concurrent"))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for a token (if rate-limited), then hold a concurrency slot (if capped)."""
        if self.bucket is not None:
            await self.bucket.acquire()
        if self.concurrency is None:
            yield
            return
        async with self.concurrency:
            yield

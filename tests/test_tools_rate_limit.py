"""trellis.tools.rate_limit: token bucket on a fake clock (no real waiting) and the concurrency cap."""

from __future__ import annotations

import asyncio

import pytest

from trellis.tools import AsyncTokenBucket, ConcurrencyLimit, ToolLimits


class FakeTime:
    """A clock that only moves when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def make(rate, capacity):
    t = FakeTime()
    return t, AsyncTokenBucket(rate, capacity, clock=t.clock, sleep=t.sleep)


def test_burst_is_available_immediately():
    async def main():
        t, bucket = make(rate=1, capacity=5)
        for _ in range(5):
            await bucket.acquire()
        assert t.now == 100.0 and t.sleeps == []
        await bucket.acquire()  # the sixth waits one token's worth
        assert t.now == pytest.approx(101.0)

    asyncio.run(main())


@pytest.mark.parametrize(("rate", "capacity", "seconds"), [(2, 5, 10), (10, 1, 3), (0.5, 3, 20)])
def test_rate_over_time_is_capacity_plus_rate_times_t(rate, capacity, seconds):
    async def main():
        t, bucket = make(rate, capacity)
        count = 0
        while True:
            await bucket.acquire()
            if t.now - 100.0 > seconds + 1e-9:
                break
            count += 1
        assert count == pytest.approx(capacity + rate * seconds, abs=1)

    asyncio.run(main())


def test_fifo_fairness_with_mixed_sizes():
    async def main():
        t, bucket = make(rate=1, capacity=4)
        await bucket.acquire(4)  # empty it
        done: list[tuple[int, int, float]] = []

        async def worker(i, n):
            await bucket.acquire(n)
            done.append((i, n, t.now))

        sizes = [1, 4, 1, 1, 3, 1, 1]
        tasks = []
        for i, n in enumerate(sizes):
            tasks.append(asyncio.create_task(worker(i, n)))
            await asyncio.sleep(0)  # arrival order is creation order
        await asyncio.gather(*tasks)
        assert [i for i, _, _ in done] == list(range(len(sizes)))
        # the big request is served as soon as 4 tokens accrue, not after the small ones behind it
        assert done[1][2] == pytest.approx(100.0 + 1 + 4)
        assert t.now == pytest.approx(100.0 + sum(sizes))
        assert bucket.tokens >= 0

    asyncio.run(main())


def test_no_negative_drift_and_refill_caps_at_capacity():
    async def main():
        t, bucket = make(rate=2, capacity=3)
        for _ in range(50):
            await bucket.acquire(3)
            assert bucket.tokens >= 0
        assert bucket.tokens == pytest.approx(0.0, abs=1e-6)
        t.now += 1000
        assert bucket.tokens == 3.0
        t.now -= 5  # a clock going backwards adds nothing and takes nothing
        assert bucket.tokens == 3.0

    asyncio.run(main())


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"cannot acquire 5 tokens from a bucket of capacity 4"):
        asyncio.run(AsyncTokenBucket(1, 4).acquire(5))
    with pytest.raises(ValueError, match=r"n must be a positive number of tokens, got 0"):
        asyncio.run(AsyncTokenBucket(1, 4).acquire(0))
    with pytest.raises(ValueError, match=r"rate must be a positive number.*got 0"):
        AsyncTokenBucket(0, 4)
    with pytest.raises(ValueError, match=r"capacity must be a number >= 1, got 0.5"):
        AsyncTokenBucket(1, 0.5)
    with pytest.raises(ValueError, match=r"max_concurrent must be an integer >= 1, got 0"):
        ConcurrencyLimit(0)


def test_concurrency_limit_caps_holders():
    async def main():
        limit = ConcurrencyLimit(2)
        peak = 0

        async def hold():
            nonlocal peak
            async with limit:
                peak = max(peak, limit.in_use)
                await asyncio.sleep(0.001)

        await asyncio.gather(*(hold() for _ in range(10)))
        assert peak == 2 and limit.in_use == 0

    asyncio.run(main())


def test_tool_limits_from_config():
    limits = ToolLimits.from_config({"rate": 5, "max_concurrent": 3})
    assert limits.bucket.rate == 5.0 and limits.bucket.capacity == 5.0
    assert limits.concurrency.max_concurrent == 3
    unlimited = ToolLimits.from_config(None)
    assert unlimited.bucket is None and unlimited.concurrency is None
    with pytest.raises(ValueError, match=r"rate_limit has unknown key\(s\) \['burst'\]"):
        ToolLimits.from_config({"rate": 1, "burst": 2})
    with pytest.raises(ValueError, match=r"capacity was given without rate_limit\.rate"):
        ToolLimits.from_config({"capacity": 2})

"""LoopThread: engines bound to one event loop, driven from many."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trellis.utils.loop_thread import LoopThread


def test_work_from_several_caller_loops_runs_on_the_one_engine_loop():
    lt = LoopThread("engine")
    try:
        state = {}

        async def start():
            # an "engine" that binds to the loop it was created on, like AsyncLLM's output handler
            state["loop"] = asyncio.get_running_loop()
            state["queue"] = asyncio.Queue()
            return threading.current_thread().name

        async def use(x):
            assert asyncio.get_running_loop() is state["loop"]
            await state["queue"].put(x)
            return await state["queue"].get() * 2

        assert asyncio.run(lt.call(start())) == "engine"
        assert asyncio.run(lt.call(use(3))) == 6  # a second asyncio.run: still fine
        assert asyncio.run(lt.call(use(4))) == 8
        assert lt.run(use(5), timeout=5) == 10  # from plain threads too
    finally:
        lt.stop()
    assert not lt.running and lt.loop.is_closed()
    lt.stop()  # idempotent


def test_cancelling_the_caller_cancels_the_work_and_errors_propagate():
    lt = LoopThread("engine")
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def caller():
        task = asyncio.ensure_future(lt.call(slow()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def boom():
        raise ValueError("engine said no")

    try:
        asyncio.run(caller())
        assert cancelled.wait(5)
        with pytest.raises(ValueError, match="engine said no"):
            asyncio.run(lt.call(boom()))
    finally:
        lt.stop()


def test_stop_cancels_pending_tasks_and_refuses_new_work():
    lt = LoopThread("engine")
    future = lt.submit(asyncio.sleep(60))
    start = time.perf_counter()
    lt.stop()
    assert time.perf_counter() - start < 5
    assert future.cancelled()
    with pytest.raises(RuntimeError, match="LoopThread 'engine' is stopped; it takes no more work"):
        lt.submit(asyncio.sleep(0))


def test_run_from_the_loop_thread_itself_is_refused():
    lt = LoopThread("engine")

    async def inner():
        with pytest.raises(RuntimeError, match="would wait for itself forever"):
            lt.run(asyncio.sleep(0))
        return True

    try:
        assert lt.run(inner(), timeout=5)
    finally:
        lt.stop()


def test_stop_joins_the_executor_threads_of_to_thread_calls():
    before = set(threading.enumerate())
    lt = LoopThread("engine")

    async def blocking_work():
        return await asyncio.to_thread(lambda: threading.current_thread().name)

    assert lt.run(blocking_work(), timeout=5) != "engine"  # ran on an executor thread of the loop
    assert len(set(threading.enumerate()) - before) == 2  # the loop's thread and one executor thread
    lt.stop()
    assert set(threading.enumerate()) - before == set()


def test_stop_from_the_loops_own_thread_finishes_the_teardown_there():
    lt = LoopThread("engine")

    async def stop_from_inside():
        lt.stop()  # e.g. a replica's finalizer that the garbage collector ran on this thread
        return "asked"

    assert lt.run(stop_from_inside(), timeout=5) == "asked"
    lt.thread.join(5)
    assert not lt.thread.is_alive() and lt.loop.is_closed() and not lt.running

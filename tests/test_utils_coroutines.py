"""trellis.utils.coroutines: run_coroutine from plain synchronous code and from inside a running loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from trellis.utils.coroutines import run_coroutine


async def _double(x: int) -> tuple[int, str]:
    await asyncio.sleep(0)
    return 2 * x, threading.current_thread().name


async def _fail() -> None:
    raise ValueError("bad value 3; pass 4")


def test_runs_on_a_fresh_loop_in_this_thread():
    assert run_coroutine(_double(21)) == (42, threading.current_thread().name)


def test_inside_a_running_loop_runs_in_a_helper_thread():
    async def caller() -> tuple[int, str]:
        return run_coroutine(_double(5))  # a synchronous call from async code: asyncio.run would refuse

    value, thread = asyncio.run(caller())
    assert value == 10
    assert thread != threading.current_thread().name


@pytest.mark.parametrize("in_loop", [False, True])
def test_exceptions_propagate(in_loop):
    async def caller() -> None:
        run_coroutine(_fail())

    with pytest.raises(ValueError, match="bad value 3; pass 4"):
        asyncio.run(caller()) if in_loop else run_coroutine(_fail())


def test_an_exception_kept_after_the_call_holds_no_frame_of_the_caller():
    # a CancelledError kept by a future used to chain (__context__) to the RuntimeError that
    # asyncio.get_running_loop raised, whose traceback held the caller's frames and so its batch
    kept: list[BaseException] = []

    async def cancelled() -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError as err:
            kept.append(err)

    run_coroutine(cancelled())
    assert len(kept) == 1
    assert kept[0].__context__ is None


def test_reward_managers_use_the_same_function():
    from trellis.reward import managers

    assert managers.run_coroutine is run_coroutine

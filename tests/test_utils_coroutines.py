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


def test_reward_managers_use_the_same_function():
    from trellis.reward import managers

    assert managers.run_coroutine is run_coroutine

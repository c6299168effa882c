"""trellis.utils.deadline: plain calls under a time limit, on the main thread and off it."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from trellis.utils.deadline import CallTimeout, call_with_deadline


def _sleepy(seconds, value="done"):
    time.sleep(seconds)
    return value


def _stubborn(seconds):
    """Swallows every Exception: only something it cannot catch stops it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except Exception:  # the point: a scorer that swallows everything
            continue
    return "finished"


def test_a_call_within_the_limit_returns_its_value_and_leaves_no_timer():
    assert call_with_deadline(_sleepy, {"seconds": 0.0, "value": 7}, 1.0) == 7
    assert call_with_deadline(_sleepy, {"seconds": 0.0}, None) == "done"
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)


def test_the_alarm_stops_an_overrun_on_the_main_thread_even_through_except_exception():
    start = time.perf_counter()
    with pytest.raises(CallTimeout, match=r"timed out after 0.2 s$"):
        call_with_deadline(_stubborn, {"seconds": 30}, 0.2)
    assert time.perf_counter() - start < 2.0
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0  # disarmed, handler restored
    with pytest.raises(ZeroDivisionError):  # the function's own errors pass through
        call_with_deadline(lambda: 1 / 0, {}, 1.0)


def test_off_the_main_thread_an_overrun_is_abandoned_in_its_thread():
    box = {}

    def worker():
        start = time.perf_counter()
        try:
            call_with_deadline(_sleepy, {"seconds": 30}, 0.2)
        except CallTimeout as exc:
            box["error"] = str(exc)
        box["seconds"] = time.perf_counter() - start
        box["value"] = call_with_deadline(_sleepy, {"seconds": 0.0, "value": 3}, 1.0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert box["error"] == "timed out after 0.2 s (the call was left running in its thread)"
    assert box["seconds"] < 2.0 and box["value"] == 3
    abandoned = [t for t in threading.enumerate() if t.name == "trellis-deadline-call"]
    assert abandoned and all(t.daemon for t in abandoned)  # never blocks the interpreter's exit


def test_someone_elses_timer_is_left_alone():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        assert call_with_deadline(_sleepy, {"seconds": 0.0, "value": 1}, 0.5) == 1  # ran in a thread
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 5.0  # still armed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []

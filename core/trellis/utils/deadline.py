"""Calling plain (synchronous) user code under a time limit, from any thread.

A scoring function that hangs must not hang the run. Python cannot stop a thread, so:

- on the main thread (the trainer's local executor), a ``SIGALRM`` interval timer interrupts the
  call: the function is unwound by an exception it cannot catch with ``except Exception``, and
  nothing is left running. This stops Python-level hangs (sleeps, loops, waits on I/O); code stuck
  inside one long C call (a catastrophic regular expression) is interrupted only when it returns.
- elsewhere (a worker thread, or a timer already set by someone else), the call runs in a daemon
  thread that is abandoned when the limit passes: the caller goes on, the thread finishes or not.

For a limit that always holds (the process is killed), score in worker processes: the ``async``
reward manager does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any


class CallTimeout(TimeoutError):
    """A call ran past its limit (``call_with_deadline``)."""


class _Overrun(BaseException):
    """Raised inside the call by the alarm; a BaseException so that the called code's own
    ``except Exception`` does not swallow it."""


def call_with_deadline(fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout: float | None) -> Any:
    """``fn(**kwargs)``, given up after ``timeout`` seconds (None: no limit).

    Raises:
        CallTimeout: the call ran past ``timeout``; the message says how long it was allowed.
        Whatever ``fn`` raises.
    """
    if timeout is None:
        return fn(**kwargs)
    if _can_use_alarm():
        return _with_alarm(fn, kwargs, timeout)
    return _in_thread(fn, kwargs, timeout)


def _can_use_alarm() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0  # no one else's timer to clobber
    )


def _with_alarm(fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout: float) -> Any:
    def overrun(signum: int, frame: Any) -> None:
        raise _Overrun

    previous = signal.signal(signal.SIGALRM, overrun)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:  # also when the alarm fired just as the call returned: it was at the limit
        raise CallTimeout(f"timed out after {timeout} s") from None
    finally:
        signal.signal(signal.SIGALRM, previous)


def _in_thread(fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout: float) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(**kwargs)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="trellis-deadline-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():  # abandoned: it cannot be stopped, and as a daemon it never blocks exit
        raise CallTimeout(f"timed out after {timeout} s (the call was left running in its thread)")
    if "error" in box:
        raise box["error"]
    return box["result"]

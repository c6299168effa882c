"""Deadlines for the stages of a training step, and the Python stacks that say where a stall is.

A run that stalls for hours, printing nothing, is the worst failure a trainer can have.
:class:`StageWatchdog` gives every stage (``with watchdog.stage("score"):``) a deadline; one
background thread watches the stage in progress and, when its deadline passes, calls the owner's
``on_expire(stage, elapsed_s, limit_s)`` once. The owner writes its report (:func:`thread_stacks` of
this process, :func:`signal_stack_dump` for worker processes) and stops the run.

Worker processes call :func:`enable_stack_dumps` when they start: ``SIGUSR1`` then makes
:mod:`faulthandler` write every thread's stack to the process's stderr (the worker's log file under
Ray), even while the worker is stuck in a long call, since faulthandler writes from the signal handler
itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal that makes a worker that called :func:`enable_stack_dumps` write its stacks."""


def thread_stacks() -> str:
    """Every thread of this process with its current Python stack, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" (id {ident}):\n{stack}')
    return "\n".join(parts)


def enable_stack_dumps() -> bool:
    """Make ``SIGUSR1`` dump every thread's stack to stderr (for :func:`signal_stack_dump`); False on
    platforms without ``SIGUSR1``."""
    if DUMP_SIGNAL is None:
        return False
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    return True


def signal_stack_dump(pid: int) -> bool:
    """Ask process ``pid`` (which called :func:`enable_stack_dumps`) to write its stacks to its stderr;
    False when it cannot be signalled (gone, another machine's, no ``SIGUSR1``)."""
    if DUMP_SIGNAL is None:
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


WAKE_SIGNAL = getattr(signal, "SIGUSR2", None)
"""The signal :func:`interrupt_main_thread` sends while :func:`arm_main_thread_wake` holds: its handler
raises :class:`KeyboardInterrupt` in the main thread."""

_wake_lock = threading.Lock()
_wake_state: dict[str, Any] = {"depth": 0, "previous": None}


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def arm_main_thread_wake() -> bool:
    """From the main thread: until :func:`disarm_main_thread_wake`, :func:`interrupt_main_thread` wakes
    the main thread with :data:`WAKE_SIGNAL`, whatever ``SIGINT``'s disposition (a process started in
    the background, ``nohup``'d or under some CI runners, inherits ``SIGINT`` ignored). Calls nest.
    Returns ``False`` (and does nothing) off the main thread or where the signal does not exist."""
    if WAKE_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    with _wake_lock:
        if _wake_state["depth"] == 0:
            _wake_state["previous"] = signal.signal(WAKE_SIGNAL, _raise_interrupt)
        _wake_state["depth"] += 1
    return True


def disarm_main_thread_wake() -> None:
    """Undo one :func:`arm_main_thread_wake`; the last one puts the signal's former handler back. Under
    the same lock as the sending, so no wake is sent once the former handler (perhaps the default
    action, which ends the process) may be back."""
    if WAKE_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return
    with _wake_lock:
        if _wake_state["depth"] == 0:
            return
        _wake_state["depth"] -= 1
        if _wake_state["depth"] == 0:
            signal.signal(WAKE_SIGNAL, _wake_state.pop("previous") or signal.SIG_DFL)
            _wake_state["previous"] = None


def interrupt_main_thread() -> str:
    """Raise :class:`KeyboardInterrupt` in the main thread, as Ctrl-C would, also while it waits in a
    blocking call (``time.sleep``, a lock, a socket read): a real signal sent to that thread cuts the
    call short and Python runs its handler at once, where :func:`_thread.interrupt_main` alone only sets
    a flag that the thread reads when it next runs Python code (and that does nothing at all while
    ``SIGINT`` is ignored). Returns how: ``"wake"`` (:data:`WAKE_SIGNAL`, while
    :func:`arm_main_thread_wake` holds), ``"sigint"`` (``SIGINT`` has a Python handler), or ``"flag"``."""
    import _thread

    main = threading.main_thread()
    ident = main.ident if hasattr(signal, "pthread_kill") and main.is_alive() else None
    with _wake_lock:
        if ident is not None and _wake_state["depth"] > 0 and WAKE_SIGNAL is not None:
            signal.pthread_kill(ident, WAKE_SIGNAL)
            return "wake"
    if ident is not None and callable(signal.getsignal(signal.SIGINT)):
        signal.pthread_kill(ident, signal.SIGINT)
        return "sigint"
    _thread.interrupt_main()
    return "flag"


def tail(path: str, lines: int = 60, max_bytes: int = 256 * 1024) -> str:
    """The last ``lines`` lines of a text file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class StageWatchdog:
    """Deadlines per stage; ``on_expire(stage, elapsed_s, limit_s)`` is called (from the watchdog's
    thread, once per stage run) when one passes.

    Args:
        default_s: the deadline of every stage (None or <= 0: none).
        overrides: per-stage deadlines by stage name (None or <= 0: that stage has none).
        on_expire: what to do; it runs on the watchdog's thread while the stage is still stuck.
        exempt: stages with no deadline unless ``overrides`` names them (e.g. the whole ``step``).
    """

    def __init__(
        self,
        default_s: float | None,
        overrides: Mapping[str, float | None] | None,
        on_expire: Callable[[str, float, float], None],
        exempt: tuple[str, ...] = (),
    ) -> None:
        self.default_s = default_s
        self.overrides = dict(overrides or {})
        self.on_expire = on_expire
        self.exempt = exempt
        self._cond = threading.Condition()
        self._active: list[tuple[str, float, float]] = []  # (stage, started, limit), innermost last
        self._thread: threading.Thread | None = None
        self._closed = False

    def limit(self, stage: str) -> float | None:
        """The deadline of ``stage`` in seconds, or None."""
        if stage in self.overrides:
            value = self.overrides[stage]
        elif stage in self.exempt:
            return None
        else:
            value = self.default_s
        return float(value) if value is not None and value > 0 else None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run the body under ``name``'s deadline (none: the body just runs)."""
        limit = self.limit(name)
        if limit is None or self._closed:
            yield
            return
        entry = (name, time.monotonic(), limit)
        with self._cond:
            self._active.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="trellis-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                if entry in self._active:
                    self._active.remove(entry)
                self._cond.notify()

    def close(self) -> None:
        """Stop watching (stages run afterwards have no deadline)."""
        with self._cond:
            self._closed = True
            self._active.clear()
            self._cond.notify()

    def _watch(self) -> None:
        fired: set[tuple[str, float, float]] = set()
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                pending = [e for e in self._active if e not in fired]
                due = [e for e in pending if now - e[1] >= e[2]]
                if not due:
                    waits = [e[1] + e[2] - now for e in pending]
                    self._cond.wait(timeout=min(waits) if waits else None)
                    continue
                expired = due[0]
                fired.add(expired)
            name, started, limit = expired
            self.on_expire(name, time.monotonic() - started, limit)

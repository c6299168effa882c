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


def interrupt_main_thread() -> bool:
    """Raise :class:`KeyboardInterrupt` in the main thread, as Ctrl-C would, also while it waits in a
    blocking call (``time.sleep``, a lock, a socket read): a real ``SIGINT`` sent to that thread cuts
    the call short and Python runs the handler at once, where :func:`_thread.interrupt_main` alone only
    sets a flag that the thread reads when it next runs Python code. Only sent when Python handles
    ``SIGINT`` (its default handler or one of the program's); ``SIG_DFL`` would kill the process and
    ``SIG_IGN`` ignore it, so there the flag is all. Returns whether the signal was sent."""
    import _thread

    main = threading.main_thread()
    if (
        callable(signal.getsignal(signal.SIGINT))
        and hasattr(signal, "pthread_kill")
        and main.ident is not None
        and main.is_alive()
    ):
        signal.pthread_kill(main.ident, signal.SIGINT)
        return True
    _thread.interrupt_main()
    return False


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

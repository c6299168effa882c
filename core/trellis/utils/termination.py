"""SIGTERM as a clean stop of a training run.

A scheduler that takes a machine back (Slurm's preemption, Kubernetes evicting a pod, ``kill``) sends
``SIGTERM`` and, a grace period later, ``SIGKILL``. Python's default action for ``SIGTERM`` ends the
process at once: no tracker finishes its run (a W&B or MLflow run stays "running"), no standalone
replica or scoring process is stopped by its owner, nothing says where the run stopped. Under Ray
the driver behaved differently again (Ray's own handler exits, after a native stack dump).

While :func:`arm_sigterm_stop` holds (``Trainer.fit`` arms it once its workers are built), the first
``SIGTERM`` raises :class:`Terminated` in the main thread, also inside a blocking call (``time.sleep``,
a lock, a socket read: the signal cuts it short). It is a :class:`SystemExit` with status
:data:`EXIT_CODE` (143, as a shell reports a process ended by ``SIGTERM``), so every ``finally`` runs
and the interpreter exits with that status without a traceback. The handler puts the default action
back first: a second ``SIGTERM`` before the trainer's shutdown ends the process at once, as before;
:func:`disarm_sigterm_stop`, which the trainer calls as it starts shutting down, puts back the handler
that was there before.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

EXIT_CODE = 128 + int(signal.SIGTERM)
"""The exit status of a run stopped by ``SIGTERM``: 143, what a shell reports for a process it ended."""


class Terminated(SystemExit):
    """Raised in the main thread by ``SIGTERM`` while :func:`arm_sigterm_stop` holds."""

    def __init__(self) -> None:
        super().__init__(EXIT_CODE)


_lock = threading.Lock()
_state: dict[str, Any] = {"armed": False, "previous": None, "received": False}


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    _state["received"] = True
    raise Terminated


def arm_sigterm_stop() -> bool:
    """From the main thread: until :func:`disarm_sigterm_stop`, ``SIGTERM`` raises :class:`Terminated`.

    Returns ``False`` (and does nothing) off the main thread, where it is already armed, or where
    ``SIGTERM`` is ignored (whoever started the process chose that; it stays so)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        current = signal.getsignal(signal.SIGTERM)
        if _state["armed"] or current == signal.SIG_IGN:
            return False
        _state.update(armed=True, previous=current, received=False)
        signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def disarm_sigterm_stop() -> None:
    """Put back the handler :func:`arm_sigterm_stop` found (a no-op where it did not arm)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        if not _state["armed"]:
            return
        previous = _state["previous"]
        _state.update(armed=False, previous=None)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def sigterm_received() -> bool:
    """Whether a ``SIGTERM`` arrived while :func:`arm_sigterm_stop` last held."""
    return bool(_state["received"])

"""Which device backend this process uses.

The rule, first match wins:

1. an explicit name — ``get_device_backend("cuda")``, typically ``trainer.device`` from the config;
2. the ``TRELLIS_DEVICE`` environment variable, when the name is None or ``"auto"``;
3. auto-selection: of the installed backends that are available, the one with the highest
   ``priority`` (npu 20 > cuda 10 > cpu 0; ties go to the alphabetically first name).

A name may also be a reference (``my_pkg.backend:MyBackend``). An explicit backend (1 or 2)
that is not available is an error, never a silent fallback: a run configured for GPUs must not
quietly train on the CPU. In auto-selection a backend that fails to load or to answer
``is_available()`` is skipped with a warning, so one broken plugin cannot stop a run.

Instances are made once per process per name and reused; ``clear_device_backend_cache()``
forgets them (tests that fake hardware need that).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trellis.device.base import DeviceBackend, DeviceUnavailableError
from trellis.errors import UnknownComponentError

__all__ = [
    "AUTO",
    "ENV_VAR",
    "clear_device_backend_cache",
    "get_communication_backend",
    "get_device_backend",
    "get_device_id",
    "get_device_name",
    "get_torch_device",
]

ENV_VAR = "TRELLIS_DEVICE"
"""Environment variable naming the device backend when the code or config says ``auto``."""
AUTO = "auto"

_logger = logging.getLogger(__name__)

# (name, class) -> instance: one instance per name per process; keyed by class as well so that
# an in-process re-registration under the same name is not shadowed by a stale instance.
_instances: dict[tuple[str, type], Any] = {}
# the installed names -> the name auto-selection chose among them
_auto_choice: dict[tuple[str, ...], str] = {}


def get_device_backend(name: str | None = None) -> DeviceBackend:
    """The device backend to use: ``name``, else ``$TRELLIS_DEVICE``, else the best available one.

    Args:
        name: a backend name (``"cpu"``, ``"cuda"``, ``"npu"``, ...) or reference; None or
            ``"auto"`` defers to ``TRELLIS_DEVICE`` and then to auto-selection by priority.

    Raises:
        DeviceUnavailableError: the named backend is not available here; the message gives the
            backend's reason and the backends that are available.
        UnknownComponentError: no backend has that name; the message lists the installed ones.
        PluginLoadError: the plugin providing the named backend fails to import.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"Device backend name must be a string such as 'cuda', or None/'auto', got {name!r} "
            f"of type {type(name).__name__}."
        )
    requested, source = _requested(name)
    if requested is None:
        return _auto_select()
    backend = _instance(requested, source)
    reason = _unavailable_reason(backend)
    if reason is not None:
        others = [n for n in _available_names() if n != requested]
        where = f" (from the environment variable {ENV_VAR})" if source == ENV_VAR else ""
        if others:
            hint = (
                f"Available here: {', '.join(others)}. Select one (trainer.device={others[0]} or "
                f"{ENV_VAR}={others[0]}), or '{AUTO}' to take the best available one."
            )
        else:
            hint = "No other backend is available here either; run 'trellis doctor'."
        raise DeviceUnavailableError(
            f"Device backend {requested!r}{where} is not available: {reason}. {hint}"
        )
    return backend


def get_device_name() -> str:
    """The torch device type of the selected backend: ``"cpu"``, ``"cuda"``, ``"npu"``, ..."""
    return get_device_backend().device_type


def get_torch_device() -> Any:
    """The selected backend's torch namespace: ``torch.cuda``, ``torch.npu``, or a CPU stand-in."""
    return get_device_backend().torch_module


def get_device_id() -> int:
    """The index of this process's current device on the selected backend (0 on CPU)."""
    return get_device_backend().current_device()


def get_communication_backend() -> str:
    """The ``torch.distributed`` backend of the selected device backend: ``"gloo"``, ``"nccl"``, ..."""
    return get_device_backend().communication_backend


def clear_device_backend_cache() -> None:
    """Forget the backend instances and the auto-selected choice (e.g. after faking hardware in a test)."""
    _instances.clear()
    _auto_choice.clear()


# ---------------------------------------------------------------- helpers


def _requested(name: str | None) -> tuple[str | None, str | None]:
    """(the name asked for, where it came from) — (None, None) means auto-select."""
    if name is not None and name.strip() and name.strip().lower() != AUTO:
        return name.strip(), "argument"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env.lower() != AUTO:
        return env, ENV_VAR
    return None, None


def _instance(name: str, source: str | None) -> Any:
    from trellis.registries import device_backends

    try:
        cls = device_backends.get(name)
    except UnknownComponentError as exc:
        if source != ENV_VAR:
            raise
        raise UnknownComponentError(
            f"{ENV_VAR}={name!r}: {exc} Or unset {ENV_VAR} to select automatically.",
            name=exc.name,
            available=exc.available,
            closest=exc.closest,
        ) from None
    key = (name, cls)
    if key not in _instances:
        _instances[key] = cls()
    return _instances[key]


def _unavailable_reason(backend: Any) -> str | None:
    """None when ``backend`` is available, else why not. Tolerates backends that raise."""
    return _availability(backend)[0]


def _availability(backend: Any) -> tuple[str | None, bool]:
    """(None when available else the reason, whether asking raised)."""
    try:
        if backend.is_available():
            return None, False
        explain = getattr(backend, "unavailable_reason", None)
        reason = explain() if callable(explain) else None
    except Exception as exc:
        return f"asking whether it is available raised {type(exc).__name__}: {exc}", True
    return reason or "its is_available() returned False (it gives no reason)", False


def _priority(name: str, backend: Any) -> int:
    priority = getattr(backend, "priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        _logger.warning("Device backend %r has a non-integer priority %r; treating it as 0.", name, priority)
        return 0
    return priority


def _available_names() -> list[str]:
    """Names of the installed backends that are available, best first. Skips broken ones."""
    from trellis.registries import device_backends

    ranked: list[tuple[int, str]] = []
    for name in device_backends.names():
        try:
            backend = _instance(name, None)
        except Exception as exc:  # one broken plugin must not stop the others from being chosen
            _logger.warning("Device backend %r is skipped: it failed to load: %s", name, exc)
            continue
        reason, raised = _availability(backend)
        if reason is None:
            ranked.append((-_priority(name, backend), name))
        else:
            _logger.log(logging.WARNING if raised else logging.DEBUG, "Device backend %r: %s", name, reason)
    return [name for _, name in sorted(ranked)]


def _auto_select() -> Any:
    from trellis.registries import device_backends

    installed = tuple(device_backends.names())
    name = _auto_choice.get(installed)
    if name is None:
        available = _available_names()
        if not available:
            raise DeviceUnavailableError(
                f"No device backend is available (installed: {', '.join(installed) or 'none'}). The "
                "built-in 'cpu' backend always is; reinstall trellis-rl if it is missing, and run "
                "'trellis doctor'."
            )
        name = _auto_choice[installed] = available[0]
        _logger.debug("Auto-selected device backend %r among available %s.", name, available)
    return _instance(name, None)

"""The random state of a process, captured for a checkpoint and restored on resume.

    state = capture_rng_state()     # after step N: put it into the checkpoint
    ...
    restore_rng_state(state)        # in the resumed process: draws continue as if never stopped

Covers every generator a training step draws from implicitly: Python's ``random``, numpy's
legacy global generator (``np.random.*``), torch's CPU generator and the generator(s) of the
selected device backend (:func:`trellis.device.get_device_backend`: every visible CUDA device,
NPU, ...). Generators a program creates itself (``torch.Generator()``, ``np.random.default_rng``,
a ``random.Random()`` instance) are its own to save.

The state holds only what ``torch.load(..., weights_only=True)`` accepts (tensors, numbers,
strings, tuples, dicts): numpy's key array travels as an int64 tensor.
"""

from __future__ import annotations

import random
from typing import Any

RNG_STATE_VERSION = 1

__all__ = ["RNG_STATE_VERSION", "capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """A copy of this process's global random states.

    Returns:
        ``{"version", "python": random.getstate(), "numpy": {...} | None, "torch": ByteTensor,
        "device": {"type": "cuda", "states": [ByteTensor per device]} | None}``; ``numpy`` is None
        when numpy is not installed, ``device`` when the device backend is the CPU (its generator
        is ``torch``'s) or has no generator state to give.
    """
    import torch

    return {
        "version": RNG_STATE_VERSION,
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "device": _device_state(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's global random states to ``state`` (from :func:`capture_rng_state`).

    Raises:
        ValueError: ``state`` is not such a state, or it holds the generators of another device
            type (or of more devices) than this process has; the message names what differs.
    """
    import torch

    if not isinstance(state, dict) or state.get("version") != RNG_STATE_VERSION:
        raise ValueError(
            f"restore_rng_state: expected a dict from capture_rng_state() (version {RNG_STATE_VERSION}), "
            f"got {type(state).__name__} with version "
            f"{state.get('version') if isinstance(state, dict) else None!r}."
        )
    missing = [key for key in ("python", "numpy", "torch", "device") if key not in state]
    if missing:
        raise ValueError(
            f"restore_rng_state: the state lacks {missing}; pass what capture_rng_state() returned."
        )
    # Check the device part before setting anything, so a mismatch leaves every generator as it was.
    device = state["device"]
    module = _device_module_for(device)
    random.setstate(_as_python_state(state["python"]))
    if state["numpy"] is not None:
        _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if module is not None:
        states = device["states"]
        if hasattr(module, "set_rng_state_all"):
            module.set_rng_state_all(states)
        else:
            module.set_rng_state(states[0])


# ---------------------------------------------------------------- python


def _as_python_state(value: Any) -> tuple:
    # random.setstate wants (version, tuple of 625 ints, gauss_next); a round trip through some
    # serialisers turns tuples into lists.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


# ---------------------------------------------------------------- numpy


def _numpy_state() -> dict[str, Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    import torch

    state = np.random.get_state(legacy=False)
    if state["bit_generator"] != "MT19937":  # the legacy global generator is always MT19937
        raise ValueError(f"numpy's global generator is {state['bit_generator']!r}; expected MT19937.")
    return {
        "bit_generator": state["bit_generator"],
        "key": torch.from_numpy(state["state"]["key"].astype(np.int64)),
        "pos": int(state["state"]["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "gauss": float(state["gauss"]),
    }


def _set_numpy_state(saved: dict[str, Any]) -> None:
    try:
        import numpy as np
    except ImportError:
        raise ValueError(
            "restore_rng_state: the state holds numpy's random state, but numpy is not installed here; "
            "install numpy (pip install numpy) to resume this run."
        ) from None
    np.random.set_state(
        {
            "bit_generator": saved["bit_generator"],
            "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": int(saved["pos"])},
            "has_gauss": int(saved["has_gauss"]),
            "gauss": float(saved["gauss"]),
        }
    )


# ---------------------------------------------------------------- device


def _device_state() -> dict[str, Any] | None:
    from trellis.device import get_device_backend

    backend = get_device_backend()
    if backend.device_type == "cpu":
        return None  # the CPU backend's generator is torch's default one, saved under "torch"
    module = backend.torch_module
    if hasattr(module, "get_rng_state_all"):
        states = list(module.get_rng_state_all())
    elif hasattr(module, "get_rng_state"):
        states = [module.get_rng_state()]
    else:
        return None
    return {"type": backend.device_type, "states": [state.cpu() for state in states]}


def _device_module_for(device: dict[str, Any] | None) -> Any:
    """The torch namespace to restore ``device`` into (None: nothing to restore); checks it fits."""
    if device is None:
        return None
    from trellis.device import get_device_backend

    backend = get_device_backend()
    if backend.device_type != device["type"]:
        raise ValueError(
            f"restore_rng_state: the state holds the random state of {device['type']!r} devices, but this "
            f"process runs on {backend.device_type!r}; resume on the same kind of device "
            f"(trainer.device={device['type']}) for a bit-identical continuation."
        )
    module = backend.torch_module
    count = module.device_count() if hasattr(module, "device_count") else 1
    if len(device["states"]) > count and hasattr(module, "set_rng_state_all"):
        raise ValueError(
            f"restore_rng_state: the state holds the random states of {len(device['states'])} "
            f"{device['type']} devices, but this process sees {count}; resume with the same devices "
            f"visible ({backend.visible_devices_env or 'the device mask'})."
        )
    return module

"""KL(π || π_ref) estimators per token, and the controllers of the in-reward KL coefficient.

The estimators (Schulman, "Approximating KL divergence", 2020) take the log-probabilities of the sampled
tokens under the policy and the reference; with x = ref_logprob − logprob = log(π_ref/π)::

    k1  = −x                 unbiased, high variance, can be negative
    abs = |x|
    k2  = ½·x²               biased, low variance; its gradient is the true KL's gradient to first order
    k3  = eˣ − x − 1         unbiased, low variance, never negative

``k1+`` and ``k3+`` are straight-through: the value of k1 / k3 with the gradient of k2.
"""

from __future__ import annotations

from typing import Any

import torch

from trellis.config.base import schema_default
from trellis.config.schema import KLControlConfig
from trellis.utils.settings import config_value

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_penalty",
]

_ALIASES = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "k1+": "k1+",
    "kl+": "k1+",
    "k3+": "k3+",
    "low_var_kl+": "k3+",
}
KL_KINDS: tuple[str, ...] = tuple(_ALIASES)
"""Every name ``kl_penalty`` accepts (aliases included)."""

_K3_CLAMP = 10.0  # k3 grows like eˣ; a clamp keeps one wild token from dominating a batch.
_EXP_CLAMP = 20.0  # k3 > 10 for |x| ≥ 20 anyway; clamping x first keeps eˣ (and its gradient) finite.


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    x = log_ratio.clamp(-_EXP_CLAMP, _EXP_CLAMP)  # x = log(π_ref/π)
    return (torch.exp(x) - x - 1).clamp(-_K3_CLAMP, _K3_CLAMP)  # k3 = eˣ − x − 1


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from the sampled tokens' log-probabilities.

    Args:
        logprob: ``(bs, T)`` log π(y_t) under the policy (may carry gradient).
        ref_logprob: ``(bs, T)`` log π_ref(y_t) under the reference.
        kind: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl`` (clamped to ±10), or the
            straight-through ``k1+``/``kl+`` and ``k3+``/``low_var_kl+``.

    Returns:
        ``(bs, T)`` estimates (not masked: apply the response mask when aggregating).

    Raises:
        ValueError: ``kind`` is not one of the names above.
    """
    canonical = _ALIASES.get(kind)
    if canonical is None:
        hint = (
            " 'full' needs the whole vocabulary distributions, not just the sampled tokens' log-probs; "
            "it is not available here."
            if kind == "full"
            else ""
        )
        raise ValueError(f"Unknown KL estimator {kind!r}. Valid kinds: {', '.join(KL_KINDS)}.{hint}")
    diff = logprob - ref_logprob  # log(π/π_ref) = −x
    if canonical == "k1":
        return diff  # k1 = log π − log π_ref
    if canonical == "abs":
        return diff.abs()  # |log π − log π_ref|
    k2 = 0.5 * diff.square()  # k2 = ½(log π − log π_ref)²
    if canonical == "k2":
        return k2
    if canonical == "k3":
        return _k3(-diff)
    forward = diff if canonical == "k1+" else _k3(-diff)
    return k2 + (forward - k2).detach()  # value of k1/k3, gradient of k2


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes.

    Raises:
        ValueError: ``kl_coef`` is negative.
    """

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}; use 0 to turn the KL penalty off.")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""


class AdaptiveKLController:
    """Steers the KL coefficient toward ``target_kl`` (Ziegler et al., 2019)::

        e     = clip(current_kl / target_kl − 1, −0.2, 0.2)
        value ← value · (1 + e · n_steps / horizon)

    ``horizon`` is how many samples (responses) it takes to adapt; ``n_steps`` counts the samples that
    produced ``current_kl``.

    Raises:
        ValueError: ``init_kl_coef`` < 0, ``target_kl`` <= 0 or ``horizon`` <= 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}.")
        if target_kl is None or target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}.")
        if horizon is None or horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` toward the coefficient that would give ``target_kl``."""
        error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)  # e = clip(KL/target − 1, ±0.2)
        self.value *= 1 + error * n_steps / self.horizon  # value ← value·(1 + e·n/horizon)


_CONTROLLER_TYPES = ("fixed", "adaptive")


def get_kl_controller(config: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller a ``KLControlConfig`` (or a dict / object with the same keys) describes.

    Keys: ``type`` (``fixed`` | ``adaptive``), ``kl_coef``, and for adaptive ``target_kl`` and
    ``horizon``; a missing key takes ``KLControlConfig``'s default (fixed, 0.001, 0.1, 10000).

    Raises:
        ValueError: unknown ``type``, or invalid values (see the controllers).
    """

    def setting(key: str) -> Any:
        return config_value(config, key, schema_default(KLControlConfig, key))

    kind, kl_coef = setting("type"), setting("kl_coef")
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, setting("target_kl"), setting("horizon"))
    raise ValueError(f"Unknown KL controller type {kind!r}. Valid types: {', '.join(_CONTROLLER_TYPES)}.")

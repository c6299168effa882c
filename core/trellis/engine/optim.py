"""The optimizer and learning-rate schedule of a trained model, built from an ``OptimConfig``.

Schedule (``LRSchedule``), for the optimizer step ``s = 0, 1, 2, ...`` (the ``s``-th call of
``optimizer_step``), with ``W`` warm-up steps, ``N = total_steps`` and ``m = min_lr_ratio``:

    s <  W:              lr · (s + 1) / W                   (linear warm-up; the last one is at lr)
    s >= W, constant:    lr
    s >= W, cosine:      lr · (m + (1 − m) · ½ · (1 + cos(π · p)))
                         p = (s − W) / (N − W − 1), clamped to [0, 1]

so the first step after warm-up runs at ``lr``, the last step (``s = N − 1``) at ``m · lr``,
and steps past ``N`` stay there. Unlike the Hugging Face schedules, no step runs at lr 0.
``W`` is ``lr_warmup_steps`` when set, else ``int(lr_warmup_steps_ratio · N)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from trellis.config.base import schema_default
from trellis.config.schema import OptimConfig
from trellis.utils.settings import setting

OPTIMIZERS = ("adamw",)
SCHEDULES = ("constant", "cosine")


def build_optimizer(
    params: Iterable[torch.Tensor], optim_config: Any, **implementation: Any
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over ``params`` with the config's lr, betas and weight decay.

    Weight decay applies to every parameter (as in verl); AdamW's eps is PyTorch's 1e-8.
    ``implementation``: AdamW's ``foreach`` / ``fused`` choice (the engine's; the
    same update up to float rounding, ~1e-8 after a few steps).

    Raises:
        ValueError: an optimizer name other than ``adamw``; no parameters to optimize.
    """
    name = str(_optim(optim_config, "name")).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name {name!r} is not supported; use one of {list(OPTIMIZERS)}.")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters (requires_grad=True).")
    beta1, beta2 = (float(beta) for beta in _optim(optim_config, "betas"))  # two: AdamW unpacks them too
    return torch.optim.AdamW(
        params,
        lr=float(_optim(optim_config, "lr")),
        betas=(beta1, beta2),
        weight_decay=float(_optim(optim_config, "weight_decay")),
        **implementation,
    )


def _optim(optim_config: Any, key: str) -> Any:
    """``key`` of an ``OptimConfig`` (or a dict, or None); missing or null: the schema's default."""
    return setting(optim_config, key, schema_default(OptimConfig, key))


class LRSchedule:
    """The lr multiplier of optimizer step ``s`` (see the module docstring).

    A callable object rather than a function, so ``LambdaLR.state_dict()`` stores its settings
    and a resumed run continues the same schedule.

    Args:
        warmup_steps: ``W >= 0``.
        total_steps: ``N``; needed for cosine, ignored by constant.
        kind: ``"constant"`` or ``"cosine"``.
        min_lr_ratio: ``m`` in [0, 1], the cosine's final multiplier.

    Raises:
        ValueError: an unknown kind, a negative ``W``, cosine without ``N`` or with ``W >= N``,
            ``m`` outside [0, 1].
    """

    def __init__(
        self, warmup_steps: int, total_steps: int | None, kind: str = "constant", min_lr_ratio: float = 0.0
    ):
        if kind not in SCHEDULES:
            raise ValueError(f"optim.lr_scheduler {kind!r} is not supported; use one of {list(SCHEDULES)}.")
        if warmup_steps < 0:
            raise ValueError(f"LRSchedule: warmup_steps={warmup_steps} must be >= 0.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={min_lr_ratio} must lie in [0, 1].")
        if kind == "cosine":
            if total_steps is None:
                raise ValueError(
                    "optim.lr_scheduler 'cosine' needs the number of optimizer steps: pass total_steps= "
                    "to the engine (the trainer's steps × optimizer steps per step)."
                )
            if warmup_steps >= total_steps:
                raise ValueError(
                    f"optim: {warmup_steps} warm-up steps leave no cosine decay within total_steps="
                    f"{total_steps}; lower lr_warmup_steps / lr_warmup_steps_ratio or raise total_steps."
                )
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.kind = kind
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps  # linear warm-up, reaching 1 on its last step
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None  # cosine: __init__ checked it
        decay_steps = self.total_steps - self.warmup_steps
        progress = 1.0 if decay_steps <= 1 else min(1.0, (step - self.warmup_steps) / (decay_steps - 1))
        # m + (1 − m)·½(1 + cos πp): 1 at p = 0, m at p = 1
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(optim_config: Any, total_steps: int | None) -> int:
    """``lr_warmup_steps`` when set, else ``int(lr_warmup_steps_ratio × total_steps)``.

    Raises:
        ValueError: a warm-up ratio > 0 without ``total_steps``.
    """
    steps = _optim(optim_config, "lr_warmup_steps")
    if steps is not None:
        return int(steps)
    ratio = float(_optim(optim_config, "lr_warmup_steps_ratio"))
    if ratio == 0.0:
        return 0
    if total_steps is None:
        raise ValueError(
            f"optim.lr_warmup_steps_ratio={ratio} needs the number of optimizer steps: pass total_steps= to "
            "the engine, or set optim.lr_warmup_steps instead."
        )
    return int(ratio * total_steps)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim_config: Any, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :class:`LRSchedule`; call its ``step()`` once per optimizer step.

    Raises:
        ValueError: as :class:`LRSchedule` and :func:`warmup_steps`.
    """
    if total_steps is not None and (isinstance(total_steps, bool) or int(total_steps) < 1):
        raise ValueError(f"total_steps={total_steps!r} must be a positive number of optimizer steps or None.")
    schedule = LRSchedule(
        warmup_steps(optim_config, total_steps),
        total_steps,
        kind=str(_optim(optim_config, "lr_scheduler")),
        min_lr_ratio=float(_optim(optim_config, "min_lr_ratio")),
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

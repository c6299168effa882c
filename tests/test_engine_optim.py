"""The optimizer and the lr schedule: warm-up, constant and cosine values checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.config.schema import OptimConfig
from trellis.engine.optim import LRSchedule, build_lr_scheduler, build_optimizer


def lrs(config: OptimConfig, total_steps: int | None, steps: int) -> list[float]:
    """The lr each of ``steps`` optimizer steps runs at."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([param], config)
    scheduler = build_lr_scheduler(optimizer, config, total_steps)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_then_cosine_to_min_lr_ratio():
    config = OptimConfig(lr=2.0, lr_warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    # warm-up 1.0, 2.0; cosine over steps 2..5: p = 0, 1/3, 2/3, 1; then stays at 0.1 × lr
    cosine = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))) for p in (0, 1 / 3, 2 / 3, 1)]
    assert cosine == pytest.approx([2.0, 1.55, 0.65, 0.2])
    assert lrs(config, total_steps=6, steps=8) == pytest.approx([1.0, 2.0, *cosine, 0.2, 0.2])


def test_warmup_ratio_and_constant():
    config = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.3)  # int(0.3 × 10) = 3 warm-up steps
    assert lrs(config, total_steps=10, steps=5) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    assert lrs(OptimConfig(lr=0.5), total_steps=None, steps=3) == [0.5, 0.5, 0.5]
    # lr_warmup_steps wins over the ratio
    config = OptimConfig(lr=1.0, lr_warmup_steps=1, lr_warmup_steps_ratio=0.5)
    assert lrs(config, total_steps=10, steps=2) == [1.0, 1.0]


def test_cosine_without_warmup_starts_at_lr():
    assert lrs(OptimConfig(lr=1.0, lr_scheduler="cosine"), total_steps=3, steps=3) == pytest.approx(
        [1.0, 0.5, 0.0]
    )


def test_schedule_state_round_trips():
    config = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler="cosine")
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], config)
    scheduler = build_lr_scheduler(optimizer, config, total_steps=5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert state["lr_lambdas"][0] == {
        "warmup_steps": 2,
        "total_steps": 5,
        "kind": "cosine",
        "min_lr_ratio": 0.0,
    }
    other = build_lr_scheduler(build_optimizer([param], config), config, total_steps=5)
    other.load_state_dict(state)
    assert other.last_epoch == 3 and other.get_last_lr() == scheduler.get_last_lr()


def test_adamw_settings():
    config = OptimConfig(lr=3e-4, betas=[0.8, 0.95], weight_decay=0.1)
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2)), frozen], config)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 0.1)
    assert len(group["params"]) == 1  # frozen parameters are left out


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"optim.name 'sgd' is not supported; use one of \['adamw'\]"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(name="sgd"))
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], OptimConfig())
    with pytest.raises(ValueError, match="cosine' needs the number of optimizer steps: pass total_steps="):
        LRSchedule(0, None, "cosine")
    with pytest.raises(ValueError, match=r"lr_warmup_steps_ratio=0.1 needs the number of optimizer steps"):
        lrs(OptimConfig(lr_warmup_steps_ratio=0.1), total_steps=None, steps=1)
    with pytest.raises(ValueError, match="4 warm-up steps leave no cosine decay within total_steps=4"):
        lrs(OptimConfig(lr_warmup_steps=4, lr_scheduler="cosine"), total_steps=4, steps=1)
    with pytest.raises(ValueError, match="lr_scheduler 'linear' is not supported"):
        LRSchedule(0, 10, "linear")
    with pytest.raises(ValueError, match="total_steps=0 must be a positive number"):
        lrs(OptimConfig(), total_steps=0, steps=1)

"""trellis.algorithms.kl: the per-token KL estimators and the KL coefficient controllers."""

from __future__ import annotations

import pytest
import torch

from trellis.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from trellis.config.schema import KLControlConfig

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])
# log π − log π_ref = [0.5, −1.0];  x = log π_ref − log π = [−0.5, 1.0]
EXPECTED = {
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "k2": [0.125, 0.5],  # ½·0.5² = 0.125, ½·1² = 0.5
    # e^−0.5 + 0.5 − 1 = 0.6065307 − 0.5 = 0.1065307;  e^1 − 1 − 1 = 2.7182818 − 2 = 0.7182818
    "k3": [0.1065307, 0.7182818],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "k1+": "k1", "kl+": "k1", "k3+": "k3"}


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", *ALIASES])
def test_hand_computed_values(kind):
    expected = EXPECTED[ALIASES.get(kind, kind)]
    assert kl_penalty(LOGP, REF, kind)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_every_kind_is_listed():
    assert set(KL_KINDS) == {"abs", "low_var_kl+", *ALIASES, *EXPECTED}


def test_k3_is_clamped_to_ten_with_finite_gradients():
    logp = torch.tensor([[0.0, -30.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-30.0, 0.0, -1.0]])
    # x = −30: e^−30 + 30 − 1 ≈ 29 → 10;  x = 30: e^30 − 31 → 10;  x = 0: 1 − 0 − 1 = 0
    value = kl_penalty(logp, ref, "k3")
    assert value.tolist() == [[10.0, 10.0, 0.0]]
    value.sum().backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize(("kind", "forward"), [("k1+", "k1"), ("k3+", "k3"), ("low_var_kl+", "k3")])
def test_straight_through_kinds_have_k2_gradients(kind, forward):
    torch.manual_seed(0)
    ref = torch.randn(3, 4)
    logp = torch.randn(3, 4, requires_grad=True)
    logp_k2 = logp.detach().clone().requires_grad_(True)
    value = kl_penalty(logp, ref, kind)
    torch.testing.assert_close(value, kl_penalty(logp.detach(), ref, forward))
    value.sum().backward()
    kl_penalty(logp_k2, ref, "k2").sum().backward()
    torch.testing.assert_close(logp.grad, logp_k2.grad)
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dlogp ½(logp − ref)² = logp − ref


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"Unknown KL estimator 'k4'\. Valid kinds: k1, kl, abs, k2, mse, k3"
    ):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match=r"'full' needs the whole vocabulary distributions"):
        kl_penalty(LOGP, REF, "full")


# ---------------------------------------------------------------- controllers


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05
    with pytest.raises(ValueError, match="kl_coef must be >= 0, got -1"):
        FixedKLController(-1)


def test_adaptive_controller_over_two_updates():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=10)
    # KL 1.5: e = clip(1.5/1 − 1) = clip(0.5) = 0.2; value = 0.1·(1 + 0.2·2/10) = 0.1·1.04 = 0.104
    controller.update(current_kl=1.5, n_steps=2)
    assert controller.value == pytest.approx(0.104, abs=1e-12)
    # KL 0.95: e = −0.05; value = 0.104·(1 − 0.05·5/10) = 0.104·0.975 = 0.1014
    controller.update(current_kl=0.95, n_steps=5)
    assert controller.value == pytest.approx(0.1014, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_kl_coef": 0.1, "target_kl": 0.0, "horizon": 10}, "target_kl must be > 0 .* got 0.0"),
        ({"init_kl_coef": 0.1, "target_kl": 1.0, "horizon": 0}, "horizon must be > 0 .* got 0"),
        ({"init_kl_coef": -0.1, "target_kl": 1.0, "horizon": 10}, "init_kl_coef must be >= 0, got -0.1"),
    ],
)
def test_adaptive_controller_validates_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveKLController(**kwargs)


def test_get_kl_controller_from_config_dict_and_object():
    fixed = get_kl_controller(KLControlConfig())
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.001
    adaptive = get_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=3.0, horizon=50))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 3.0, 50)
    from_dict = get_kl_controller({"type": "adaptive", "kl_coef": 0.5})
    assert (from_dict.value, from_dict.target, from_dict.horizon) == (0.5, 0.1, 10000)

    class Plain:  # an object with attributes only
        type = "fixed"
        kl_coef = 0.3

    assert get_kl_controller(Plain()).value == 0.3
    default = get_kl_controller({})
    assert isinstance(default, FixedKLController) and default.value == 0.001
    with pytest.raises(ValueError, match=r"Unknown KL controller type 'pid'\. Valid types: fixed, adaptive"):
        get_kl_controller({"type": "pid"})


def test_config_accepts_exactly_the_kl_kinds():
    from typing import get_args

    from trellis.config.schema import KLEstimator

    assert set(get_args(KLEstimator)) == set(KL_KINDS)

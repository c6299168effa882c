"""The off-policy objectives' helpers (``algorithm.off_policy: decoupled | behaviour``)."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.algorithms.off_policy import behaviour_log_probs, decoupled_weights


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_weights_are_proximal_over_behaviour_zero_off_the_mask_and_above_the_cap():
    prox = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)], [math.log(0.3), 0.0, 0.0]])
    behav = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)], [math.log(0.3), -5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, metrics = decoupled_weights(prox, behav, mask, cap=5.0)
    expected = torch.tensor(
        [[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    )  # 9.0 > 5 and exp(5) > 5 capped; [1, 2] off the mask
    torch.testing.assert_close(weights, expected)
    assert metrics["off_policy/capped_fraction"] == pytest.approx(2 / 5)
    assert metrics["off_policy/is_weight/mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert metrics["off_policy/is_weight/max"] == pytest.approx(2.0)
    log_ratio = (prox - behav) * mask
    assert metrics["off_policy/kl_behav"] == pytest.approx(float(-log_ratio.sum() / 5))
    uncapped, metrics = decoupled_weights(prox, behav, mask, cap=None)
    assert uncapped[0, 2] == pytest.approx(9.0) and uncapped[1, 1] == pytest.approx(math.exp(5))
    assert metrics["off_policy/capped_fraction"] == 0.0


def test_weights_carry_no_gradient_and_shapes_must_match():
    prox = torch.zeros(2, 3, requires_grad=True)
    weights, _ = decoupled_weights(prox, torch.zeros(2, 3), torch.ones(2, 3), cap=2.0)
    assert not weights.requires_grad and torch.equal(weights, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"shapes differ: proximal \(2, 3\), behaviour \(2, 4\)"):
        decoupled_weights(prox, torch.zeros(2, 4), torch.ones(2, 3), cap=2.0)


def test_behaviour_log_probs_are_the_rollouts_detached_or_a_clear_error():
    behaviour = torch.tensor([[-0.5, -1.5], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    old = behaviour_log_probs({"rollout_log_probs": behaviour, "response_mask": mask})
    assert old.dtype == torch.float32 and not old.requires_grad
    torch.testing.assert_close(old, behaviour.detach().float())
    with pytest.raises(ValueError, match=r"off_policy=behaviour: the rollout has no rollout_log_probs"):
        behaviour_log_probs({"response_mask": mask})
    with pytest.raises(ValueError, match=r"rollout_log_probs has shape \(2, 3\), the responses \(2, 2\)"):
        behaviour_log_probs({"rollout_log_probs": torch.zeros(2, 3), "response_mask": mask})

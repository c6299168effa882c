"""trellis.algorithms.objective: the PPO / GRPO objective as pure functions (KL in the reward,
advantages with declared inputs, actor loss, critic loss), checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.algorithms import objective
from trellis.algorithms.kl import kl_penalty
from trellis.algorithms.policy_loss import compute_policy_loss_vanilla, compute_value_loss
from trellis.registries import requires

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
INFO = {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2}


def setup_module():
    torch.set_num_threads(1)


def _approx(value, expected, abs=1e-6):
    assert float(torch.as_tensor(value).detach()) == pytest.approx(expected, abs=abs)


# ---------------------------------------------------------------- 1. KL in the reward


def test_kl_in_reward_subtracts_beta_times_the_kl_on_the_mask():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -5.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.5], [-1.0, -3.0, 0.0]])
    rewards, kl = objective.kl_in_reward(scores, old, ref, MASK, kl_coef=0.1, kl_penalty_kind="kl")
    # k1: KL_t = log π_old − log π_ref, 0 off the mask (the padded 9.0 keeps its value: no KL there)
    expected_kl = torch.tensor([[0.5, 0.0, -0.5], [0.0, 2.0, 0.0]])
    torch.testing.assert_close(rewards, scores - 0.1 * expected_kl)
    torch.testing.assert_close(kl, torch.tensor([0.0, 1.0]))  # per response: mean over its 3 and 2 tokens


# ---------------------------------------------------------------- 2. advantages


def test_the_estimator_gets_exactly_the_inputs_it_declares():
    seen = {}

    @requires("values", "groups")
    def with_values(token_level_rewards, response_mask, *, index=None, config=None, **extra):
        seen["values"] = sorted(extra)
        return extra["values"], extra["values"]

    def plain(token_level_rewards, response_mask, *, index=None, config=None, **extra):
        seen["plain"] = sorted(extra)
        return token_level_rewards, token_level_rewards

    rewards, values = torch.ones(2, 3), torch.full((2, 3), 0.5)
    inputs = {"values": values, "reward_baselines": torch.zeros(2), "ref_log_prob": torch.zeros(2, 3)}
    advantages, _ = objective.compute_advantages(with_values, rewards, MASK, index=["a", "a"], inputs=inputs)
    assert advantages is values and seen["values"] == ["values"]
    objective.compute_advantages(plain, rewards, MASK, index=["a", "a"], inputs=inputs)
    assert seen["plain"] == []  # nothing it did not ask for
    with pytest.raises(
        ValueError, match=r"declares it needs \['values'\] but the batch has none: values: the"
    ):
        objective.compute_advantages(with_values, rewards, MASK, index=["a", "a"], inputs={})


def test_remax_by_name_uses_the_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    advantages, returns = objective.compute_advantages(
        "remax", rewards, MASK, index=None, inputs={"reward_baselines": torch.tensor([0.25, 1.0])}
    )
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.75, 0.75], [2.0, 2.0, 0.0]]))


# ---------------------------------------------------------------- 3. actor loss


def _case():
    log_prob = torch.tensor([[-1.0, -0.5, -2.0], [-1.2, -0.3, -4.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -0.5, -1.5], [-1.0, -0.4, -4.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -0.7, -2.0], [-1.2, -0.1, -1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    entropy = torch.tensor([[2.0, 1.0, 0.5], [1.5, 1.0, 9.0]], dtype=torch.float64, requires_grad=True)
    return log_prob, old, ref, advantages, entropy


def test_actor_loss_is_the_policy_loss_minus_the_entropy_bonus_plus_the_kl_loss():
    log_prob, old, ref, advantages, entropy = _case()
    loss, metrics = objective.actor_loss(
        log_prob, old, advantages, MASK, policy_loss="vanilla", loss_agg_mode="token-mean",
        global_batch_info=INFO, entropy=entropy, entropy_coeff=0.01, ref_log_prob=ref, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
    )  # fmt: skip
    pg, _ = compute_policy_loss_vanilla(old, log_prob, advantages, MASK, global_batch_info=INFO)
    mask = MASK.double()
    entropy_mean = float((entropy * mask).sum() / 5)  # token-mean over the 5 masked tokens
    kl_mean = float((kl_penalty(log_prob, ref, "low_var_kl") * mask).sum() / 5)
    _approx(loss, float(pg) - 0.01 * entropy_mean + 0.1 * kl_mean)
    _approx(metrics["actor/pg_loss"], float(pg))  # one micro-batch holding the whole batch
    _approx(metrics["actor/entropy"], entropy_mean)
    _approx(metrics["actor/kl_loss"], kl_mean)
    assert {"actor/pg_clipfrac", "actor/ppo_kl"} <= set(metrics)
    loss.backward()
    assert entropy.grad is not None and float(entropy.grad[1, 2]) == 0.0  # masked token: no gradient


def test_on_policy_old_log_probs_are_the_current_ones():
    log_prob, _, _, advantages, _ = _case()
    loss, metrics = objective.actor_loss(
        log_prob,
        None,
        advantages,
        MASK,
        policy_loss="vanilla",
        loss_agg_mode="token-mean",
        global_batch_info=INFO,
    )
    # ratio 1 everywhere: L = −mean(A) over the masked tokens, and the gradient is −A / N per token
    _approx(loss, -(3 * 1.0 + 2 * -0.5) / 5)
    _approx(metrics["actor/ppo_kl"], 0.0)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, -advantages * MASK / 5)


def _vanilla(log_prob, old, advantages, info):
    return objective.actor_loss(
        log_prob,
        old,
        advantages,
        MASK,
        policy_loss="vanilla",
        loss_agg_mode="token-mean",
        global_batch_info=info,
    )


def test_global_batch_info_scales_the_loss_and_the_metric_stays_the_micro_batch_mean():
    log_prob, old, _, advantages, _ = _case()
    local, _ = _vanilla(log_prob, old, advantages, INFO)
    share, metrics = _vanilla(
        log_prob, old, advantages, {"dp_size": 2, "batch_num_tokens": 20, "global_batch_size": 8}
    )
    _approx(share, float(local) * 5 / 20 * 2)  # Σ over this micro-batch / N_global × dp
    _approx(metrics["actor/pg_loss"], float(local))


def test_a_kl_loss_without_the_reference_is_an_error():
    log_prob, old, _, advantages, _ = _case()
    with pytest.raises(ValueError, match=r"kl_loss_coef=0.1 needs ref_log_prob .* enable the reference"):
        objective.actor_loss(
            log_prob, old, advantages, MASK, policy_loss="vanilla", loss_agg_mode="token-mean",
            global_batch_info=INFO, kl_loss_coef=0.1,
        )  # fmt: skip


def test_a_policy_loss_gets_the_inputs_it_declares():
    log_prob, old, ref, advantages, _ = _case()
    got = {}

    @requires("ref_log_prob", "rollout_log_probs")
    def anchored(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None, global_batch_info=None, **needs):  # fmt: skip
        got.update(needs, info=global_batch_info, mode=loss_agg_mode, clip=config["clip_ratio"])
        return ((log_prob - needs["ref_log_prob"]) ** 2 * response_mask).sum(), {}

    rollout = old - 0.01
    loss, _ = objective.actor_loss(
        log_prob, old, advantages, MASK, policy_loss=anchored, loss_agg_mode="seq-mean-token-mean",
        global_batch_info=INFO, config={"clip_ratio": 0.3}, ref_log_prob=ref,
        inputs={"rollout_log_probs": rollout, "values": torch.zeros(2, 3)},
    )  # fmt: skip
    assert sorted(got) == ["clip", "info", "mode", "ref_log_prob", "rollout_log_probs"]  # no values
    assert got["ref_log_prob"] is ref and got["rollout_log_probs"] is rollout and got["info"] is INFO
    assert (got["mode"], got["clip"]) == ("seq-mean-token-mean", 0.3)
    _approx(loss, float(((log_prob - ref) ** 2 * MASK).sum()))


# ---------------------------------------------------------------- 4. critic loss


def test_critic_loss_is_the_clipped_value_loss_with_its_metrics():
    vpreds = torch.tensor([[0.5, 1.5, 0.0], [2.0, -1.0, 7.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = objective.critic_loss(
        vpreds, returns, values, MASK, cliprange_value=0.5, loss_agg_mode="token-mean", global_batch_info=INFO
    )
    expected, value_metrics = compute_value_loss(vpreds, returns, values, MASK, 0.5, global_batch_info=INFO)
    _approx(loss, float(expected))
    _approx(metrics["critic/vf_loss"], float(expected))
    _approx(metrics["critic/vf_clipfrac"], float(value_metrics["critic/vf_clipfrac"]))
    _approx(metrics["critic/vpred_mean"], (0.5 + 1.5 + 0.0 + 2.0 - 1.0) / 5)
    assert math.isfinite(float(loss)) and loss.requires_grad

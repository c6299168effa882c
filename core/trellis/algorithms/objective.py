"""The whole PPO / GRPO objective, top to bottom, as pure functions on tensors.

A training step computes, in this order (``Trainer.train_step`` calls each where its stage runs)::

    1. KL in the reward      r_t = s_t − β·KL_t(π_old ‖ π_ref)        (algorithm.use_kl_in_reward)
    2. advantages            A, G = estimator(r, m, index=uid, **what it declares)
    3. actor loss            L_actor  = L_pg(π_θ, π_old, A) − c_H·agg(H_θ) + c_KL·agg(KL(π_θ ‖ π_ref))
    4. critic loss           L_critic = agg(½·max((V_φ − G)², (V_old + clip(V_φ − V_old, −c, c) − G)²))

with ``s_t`` the reward manager's token-level scores (the response's score on its last token), ``m`` the
response mask (1 on tokens the policy generated), ``agg`` the loss aggregation of
:mod:`trellis.algorithms.aggregation` over the global mini-batch, and ``L_pg`` the configured policy loss
(:mod:`trellis.algorithms.policy_loss`).

GRPO is ``estimator = grpo`` (A_i = (R_i − mean_g) / (std_g + ε) within each prompt's group), no critic,
``L_pg = vanilla`` (the clipped ratio max(−A·r, −A·clip(r, 1 − ε, 1 + ε))) and the KL in the loss
(``actor.use_kl_loss``, k3). PPO is ``estimator = gae`` with a critic trained on ``L_critic`` and, in
the classic RLHF form, the KL in the reward.

Estimators and policy losses declare what they need (``trellis.registries.NEEDS``): they are called with
exactly the inputs they declare, and a missing one is an error that names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trellis.algorithms.aggregation import GlobalBatchInfo, agg_loss
from trellis.algorithms.kl import kl_penalty
from trellis.algorithms.masked import masked_mean
from trellis.algorithms.policy_loss import compute_value_loss
from trellis.registries import NEEDS, get_adv_estimator_fn, get_policy_loss_fn, needs_of

INPUT_NEEDS = tuple(need for need in NEEDS if need != "groups")
"""The needs that are inputs: a component that declares one is called with it as a keyword argument."""

Metrics = dict[str, torch.Tensor]


# ---------------------------------------------------------------- 1. KL in the reward


def kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty_kind: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with the KL to the reference subtracted (the classic RLHF penalty).

    Args:
        token_level_scores, old_log_probs, ref_log_prob, response_mask: ``(bs, T)``.
        kl_coef: β, the penalty's weight (the KL controller's current value).
        kl_penalty_kind: the estimator of KL_t (``trellis.algorithms.kl.KL_KINDS``).

    Returns:
        ``(token_level_rewards (bs, T), kl (bs,))``: the rewards, and each response's mean KL over its
        masked tokens (what an adaptive controller steers by).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(old_log_probs, ref_log_prob, kl_penalty_kind) * mask  # KL_t, 0 off the mask
    rewards = token_level_scores - kl_coef * kl  # r_t = s_t − β·KL_t
    return rewards, masked_mean(kl, mask, axis=-1)


# ---------------------------------------------------------------- 2. advantages


def declared_inputs(component: Callable[..., Any], inputs: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The keyword arguments ``component`` declares it needs, taken from ``inputs``.

    Raises:
        ValueError: a declared input is missing from ``inputs`` (the message names it and the component).
    """
    needs = needs_of(component, kind)
    wanted = [need for need in INPUT_NEEDS if need in needs]
    missing = [need for need in wanted if inputs.get(need) is None]
    if missing:
        name = getattr(component, "__name__", repr(component))
        raise ValueError(
            f"The {kind} {name} declares it needs {missing} but the batch has none: "
            + "; ".join(f"{need}: {NEEDS[need]}" for need in missing)
            + "."
        )
    return {need: inputs[need] for need in wanted}


def compute_advantages(
    estimator: str | Callable[..., Any],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any,
    config: Any = None,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A, G = estimator(r, m, index=index, config=config, **declared)``.

    Args:
        estimator: a registered name (``algorithm.adv_estimator``) or the function itself.
        token_level_rewards, response_mask: ``(bs, T)``.
        index: one group id per sample (the prompt's uid).
        config: the estimator's settings (``AlgorithmConfig``: gamma, lam, norm_adv_by_std_in_grpo).
        inputs: what the run can provide (``values``, ``reward_baselines``, ...); only what the estimator
            declares is passed.

    Returns:
        ``(advantages, returns)``, both ``(bs, T)``.
    """
    fn = get_adv_estimator_fn(estimator) if isinstance(estimator, str) else estimator
    extra = declared_inputs(fn, inputs or {}, "advantage estimator")
    advantages, returns = fn(token_level_rewards, response_mask, index=index, config=config, **extra)
    return advantages, returns


# ---------------------------------------------------------------- 3. actor loss


def actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    policy_loss: str | Callable[..., Any],
    loss_agg_mode: str,
    global_batch_info: GlobalBatchInfo,
    config: Any = None,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    rollout_is_weights: torch.Tensor | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``L_actor = L_pg − c_H·agg(H) + c_KL·agg(KL(π_θ ‖ π_ref))`` for one micro-batch.

    Args:
        log_prob: ``(bs, T)`` log π_θ of the response tokens, carrying the gradient.
        old_log_prob: ``(bs, T)`` log π_old; None on an on-policy step (one optimizer step over the whole
            batch), where π_old is π_θ itself, so ``log_prob.detach()`` stands in (and the ratio is 1).
        advantages, response_mask: ``(bs, T)``.
        policy_loss: a registered name (``actor.policy_loss``) or the function.
        loss_agg_mode: how token losses become one number (``actor.loss_agg_mode``).
        global_batch_info: the counts of the whole global mini-batch (from the engine).
        config: the policy loss's own settings (``ActorConfig``: clip ratios, ``policy_loss_kwargs``).
        entropy: ``(bs, T)`` H(π_θ) per token, with gradient; None when the engine did not compute it.
        entropy_coeff: c_H, the entropy bonus (0 = none).
        ref_log_prob: ``(bs, T)`` log π_ref; needed when ``kl_loss_coef`` > 0.
        kl_loss_coef: c_KL (0 = no KL loss).
        kl_loss_type: the KL estimator (``actor.kl_loss_type``).
        rollout_is_weights: ``(bs, T)`` rollout-correction importance weights, or None.
        inputs: what else the batch holds (``ref_log_prob``, ``rollout_log_probs``, ...), passed to the
            policy loss when it declares it needs them.

    Returns:
        ``(loss, metrics)``: the 0-d loss to back-propagate (this micro-batch's share of the global
        mini-batch's loss) and detached metrics ``actor/pg_loss`` (this micro-batch's own mean),
        ``actor/entropy``, ``actor/kl_loss`` and the policy loss's own.

    Raises:
        ValueError: a KL loss without ``ref_log_prob``; an input the policy loss declares is missing.
    """
    fn = get_policy_loss_fn(policy_loss) if isinstance(policy_loss, str) else policy_loss
    old = log_prob.detach() if old_log_prob is None else old_log_prob  # π_old = π_θ on-policy
    available = {"ref_log_prob": ref_log_prob, **dict(inputs or {})}
    extra = declared_inputs(fn, available, "policy loss")
    mask = response_mask.to(torch.float32)
    info = global_batch_info

    pg_loss, pg_metrics = fn(
        old,
        log_prob,
        advantages,
        mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        global_batch_info=global_batch_info,
        **extra,
    )
    metrics: Metrics = dict(pg_metrics)
    metrics["actor/pg_loss"] = _own_mean(pg_loss, mask, info)
    loss = pg_loss

    if entropy is not None:
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if entropy_coeff:
            loss = loss - entropy_coeff * agg_loss(entropy, mask, loss_agg_mode, **info)  # − c_H·agg(H)

    if kl_loss_coef:
        if ref_log_prob is None:
            raise ValueError(
                f"actor_loss: kl_loss_coef={kl_loss_coef} needs ref_log_prob (the reference policy's "
                "log-probs); enable the reference (ref.enable) or set the coefficient to 0."
            )
        kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)  # KL_t(π_θ ‖ π_ref)
        loss = loss + kl_loss_coef * agg_loss(kl, mask, loss_agg_mode, **info)  # + c_KL·agg(KL)
        metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
    return loss, metrics


# ---------------------------------------------------------------- 4. critic loss


def critic_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    global_batch_info: GlobalBatchInfo,
) -> tuple[torch.Tensor, Metrics]:
    """``L_critic = agg(½·max((V_φ − G)², (V_old + clip(V_φ − V_old, −c, c) − G)²))`` for one micro-batch.

    Args:
        vpreds: ``(bs, T)`` V_φ of the critic being trained (carries the gradient).
        returns: ``(bs, T)`` the targets G (from the estimator).
        values: ``(bs, T)`` V_old, the critic's values when the batch was generated.
        response_mask: ``(bs, T)``.
        cliprange_value: c (``critic.cliprange_value``).
        loss_agg_mode: ``critic.loss_agg_mode``.
        global_batch_info: the counts of the whole global mini-batch (from the engine).

    Returns:
        ``(loss, metrics)`` with ``critic/vf_loss``, ``critic/vf_clipfrac`` and ``critic/vpred_mean``.
    """
    mask = response_mask.to(torch.float32)
    loss, value_metrics = compute_value_loss(
        vpreds, returns, values, mask, cliprange_value, loss_agg_mode, global_batch_info=global_batch_info
    )
    metrics: Metrics = dict(value_metrics)
    metrics["critic/vf_loss"] = _own_mean(loss, mask, global_batch_info)
    metrics["critic/vpred_mean"] = masked_mean(vpreds.detach(), mask)
    return loss, metrics


def _own_mean(loss: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    """A micro-batch's loss as a metric: the loss is its share of the global mini-batch's mean (scaled by
    the data-parallel size, whose gradients are averaged); the metric undoes the share, giving the
    micro-batch's own mean whatever the number of ranks and micro-batches."""
    share = float(mask.sum()) * info.get("dp_size", 1) / max(1.0, float(info.get("batch_num_tokens") or 1))
    return loss.detach() / max(share, 1e-12)

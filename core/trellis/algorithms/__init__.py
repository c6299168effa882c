"""RL algorithm math: the PPO / GRPO objective, advantage estimators, policy losses, KL, loss
aggregation, rollout correction and log-prob kernels. Pure functions on tensors, with no dependency
on the trainer.

Shapes: ``(bs, T)`` over response tokens; ``response_mask`` is 1 on tokens the policy generated
(0 on padding and on tool-output tokens). Read :mod:`trellis.algorithms.objective` first: it is the
whole objective top to bottom. Estimators and losses are registered through the core's entry points
(``trellis.advantage_estimators``, ``trellis.policy_losses``)::

    from trellis.algorithms import agg_loss, get_adv_estimator_fn, kl_penalty, register_adv_est

Every name below is imported on first access, so ``import trellis.algorithms`` does not import torch.
"""

from __future__ import annotations

from trellis.utils.lazy import lazy_attributes


def _names(module: str, *names: str) -> dict[str, str]:
    return {name: f"trellis.algorithms.{module}:{name}" for name in names}


_LAZY: dict[str, str] = {
    # the accessors RL users know (they live with the registries)
    **{
        name: f"trellis.registries:{name}"
        for name in (
            "get_adv_estimator_fn",
            "register_adv_est",
            "get_policy_loss_fn",
            "register_policy_loss",
            "requires",
            "needs_of",
            "NEEDS",
        )
    },
    **_names("objective", "kl_in_reward", "compute_advantages", "actor_loss", "critic_loss"),
    **_names("aggregation", "agg_loss", "GlobalBatchInfo", "LOSS_AGG_MODES"),
    **_names(
        "kl", "kl_penalty", "get_kl_controller", "FixedKLController", "AdaptiveKLController", "KL_KINDS"
    ),
    **_names("logprobs", "logprobs_from_logits", "entropy_from_logits", "logprobs_and_entropy_from_logits"),
    **_names("masked", "masked_sum", "masked_mean", "masked_var", "masked_whiten"),
    **_names(
        "advantage",
        "compute_gae_advantage_return",
        "compute_grpo_outcome_advantage",
        "compute_grpo_passk_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_opo_outcome_advantage",
        "compute_gpg_outcome_advantage",
        "compute_reinforce_plus_plus_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        "compute_remax_outcome_advantage",
    ),
    **_names(
        "policy_loss",
        "compute_policy_loss_vanilla",
        "compute_policy_loss_gspo",
        "compute_policy_loss_gpg",
        "compute_policy_loss_clip_cov",
        "compute_policy_loss_kl_cov",
        "compute_policy_loss_geo_mean",
        "compute_policy_loss_cispo",
        "compute_policy_loss_sapo",
        "compute_value_loss",
        "compute_entropy_loss",
    ),
    **_names(
        "rollout_correction",
        "compute_rollout_correction_and_rejection_mask",
        "rollout_correction_from_config",
    ),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes("trellis.algorithms", _LAZY, globals())

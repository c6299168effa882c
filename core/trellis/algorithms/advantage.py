"""Advantage estimators: turn token-level rewards into advantages (and returns) for the policy loss.

Every estimator has the call convention of the ``trellis.advantage_estimators`` registry::

    fn(token_level_rewards, response_mask, *, index=None, config=None, **extra) -> (advantages, returns)

* ``token_level_rewards``, ``response_mask``: ``(bs, T)`` over response tokens. The mask is 1 on tokens
  the policy generated, 0 on padding and on tool-output tokens inside a response. Rewards outside the
  mask are ignored.
* ``index``: one group id per sample (the prompt uid; a numpy array, list or tensor of length ``bs``).
  Samples with the same id answer the same prompt. Group estimators need it.
* ``config``: None, a dict, or a config object with ``.get(key, default)`` (``AlgorithmConfig``). Read
  keys: ``gamma`` (γ, default 1), ``lam`` (λ, default 1), ``norm_adv_by_std_in_grpo`` (default True)
  and ``epsilon`` (ε, default 1e-6; an ``epsilon=`` keyword wins over the config).
* ``extra``: the inputs an estimator declares it needs (``@requires(...)``, its ``requires`` attribute;
  vocabulary in ``trellis.registries.NEEDS``): ``values`` (gae), ``reward_baselines`` (remax). The
  trainer calls each estimator with exactly the inputs it declares; ``groups`` declares that it compares
  the responses to one prompt, so the run needs ``rollout.n >= 2``.

Both outputs are ``(bs, T)`` and zero outside the mask. R_i = Σ_t r_{i,t} over the mask is the score of
sample i; "outcome" estimators give every masked token of a response the same advantage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trellis.algorithms.masked import masked_sum, masked_whiten
from trellis.config.base import schema_default
from trellis.config.schema import AlgorithmConfig
from trellis.registries import requires
from trellis.utils.settings import config_value

__all__ = [
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
]


# ---------------------------------------------------------------- helpers


def _setting(config: Any, key: str) -> Any:
    """``key`` of ``config`` (None, a dict or an AlgorithmConfig); missing: the schema's default."""
    return config_value(config, key, schema_default(AlgorithmConfig, key))


def _epsilon(config: Any, extra: dict[str, Any]) -> float:
    return float(extra["epsilon"]) if "epsilon" in extra else float(config_value(config, "epsilon", 1e-6))


def _check_inputs(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Check the ``(bs, T)`` shapes; return the mask as a float tensor of the rewards' dtype."""
    if not isinstance(token_level_rewards, torch.Tensor) or not isinstance(response_mask, torch.Tensor):
        raise TypeError(
            f"{name}: token_level_rewards and response_mask must be torch tensors, got "
            f"{type(token_level_rewards).__name__} and {type(response_mask).__name__}."
        )
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"{name}: token_level_rewards and response_mask must both be (bs, T); got shapes "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}."
        )
    if not token_level_rewards.is_floating_point():
        raise TypeError(
            f"{name}: token_level_rewards must be a floating-point tensor, got {token_level_rewards.dtype}; "
            "convert it with .float()."
        )
    return response_mask.to(token_level_rewards.dtype)


def _required_extra(name: str, extra: dict[str, Any], key: str, why: str) -> Any:
    if extra.get(key) is None:
        raise ValueError(f"{name} needs {key}= ({why}); pass it as a keyword argument.")
    return extra[key]


def _group_ids(name: str, index: Any, bs: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """Map group ids to ``0..G-1``: returns (inverse ``(bs,)`` long tensor, the G distinct ids)."""
    if index is None:
        raise ValueError(
            f"{name} needs index= (one group id per sample, e.g. the prompt uid) to compare the responses "
            "to one prompt."
        )
    ids = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if ids.ndim != 1 or len(ids) != bs:
        raise ValueError(
            f"{name}: index must hold one group id per sample ({bs}); got an array of shape {ids.shape}."
        )
    uniques, inverse = np.unique(ids, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), uniques


def _group_sum(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def _group_stats(
    scores: torch.Tensor, inverse: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: (size n_g, mean_g, unbiased std_g), with mean 0 and std 1 for a group of one."""
    counts = _group_sum(torch.ones_like(scores), inverse, n_groups)
    mean = _group_sum(scores, inverse, n_groups) / counts  # mean_g = Σ_{i∈g} R_i / n_g
    squares = _group_sum((scores - mean[inverse]) ** 2, inverse, n_groups)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))  # std_g = sqrt(Σ (R_i − mean_g)² / (n_g − 1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return counts, mean, std


def _broadcast(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sample ``(bs,)`` score on every masked token of its response; 0 elsewhere."""
    return scores.unsqueeze(-1) * mask


# ---------------------------------------------------------------- critic-based


@requires("values")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) with a critic.

    Needs ``values`` ``(bs, T)``: the critic's V_t on each response token. Over the masked-in tokens of
    a response, with t' the next masked-in token after t (tool-output tokens are skipped, not zeroed)::

        δ_t = r_t + γ·V_{t'} − V_t          (V after the last masked-in token is 0)
        A_t = δ_t + γλ·A_{t'}
        returns_t = A_t + V_t

    The advantages are then whitened over all masked tokens of the batch (mean 0, unit variance).

    Returns:
        (advantages, returns), both ``(bs, T)`` and zero outside the mask.

    Raises:
        ValueError: ``values`` is missing or not ``(bs, T)``.
    """
    name = "gae"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    values = _required_extra(name, extra, "values", "the critic's value of each response token, (bs, T)")
    if not isinstance(values, torch.Tensor) or values.shape != token_level_rewards.shape:
        raise ValueError(
            f"{name}: values must be a (bs, T) tensor like token_level_rewards "
            f"{tuple(token_level_rewards.shape)}; got {getattr(values, 'shape', type(values).__name__)}."
        )
    values = values.to(token_level_rewards.dtype)
    gamma = float(_setting(config, "gamma"))
    lam = float(_setting(config, "lam"))

    keep = mask.bool()
    bs, T = token_level_rewards.shape
    next_value = token_level_rewards.new_zeros(bs)  # V of the next masked-in token (0 past the end)
    next_advantage = token_level_rewards.new_zeros(bs)  # A of the next masked-in token
    advantages = torch.zeros_like(token_level_rewards)
    for t in reversed(range(T)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]  # δ_t = r_t + γV_{t'} − V_t
        advantage = delta + gamma * lam * next_advantage  # A_t = δ_t + γλ·A_{t'}
        # A masked-out token leaves the recursion untouched, so the token before it sees t'.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(keep[:, t], advantage, torch.zeros_like(advantage))

    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    returns = torch.where(keep, advantages + values, zero)  # returns_t = A_t + V_t
    advantages = torch.where(keep, masked_whiten(advantages, mask), zero)
    return advantages, returns


# ---------------------------------------------------------------- group baselines


@requires("groups")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al., 2024): each response's score normalised within its prompt's group::

        A_i = (R_i − mean_g) / (std_g + ε)     (std_g unbiased, as torch.std)
        A_i = R_i − mean_g                     (norm_adv_by_std_in_grpo=False: Dr. GRPO)

    A group of one has mean_g = 0 and std_g = 1. A_i is put on every masked token; returns = advantages.

    Raises:
        ValueError: ``index`` is missing or not of length ``bs``.
    """
    name = "grpo"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    inverse, groups = _group_ids(name, index, scores.shape[0], scores.device)
    _, mean, std = _group_stats(scores, inverse, len(groups))
    scores = scores - mean[inverse]  # R_i − mean_g
    if _setting(config, "norm_adv_by_std_in_grpo"):
        scores = scores / (std[inverse] + _epsilon(config, extra))  # (R_i − mean_g) / (std_g + ε)
    advantages = _broadcast(scores, mask)
    return advantages, advantages


@requires("groups")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best response of each group is credited, by its margin over the runner-up::

        A_best = R_max − R_second              (÷ (std_g + ε) when norm_adv_by_std_in_grpo)
        A_i    = 0                             for every other response of the group

    On a tie for the best score the first sample (lowest batch position) is the best, with margin 0.
    A_i is put on every masked token; returns = advantages.

    Raises:
        ValueError: ``index`` is missing, or a group has fewer than 2 samples.
    """
    name = "grpo_passk"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    bs = scores.shape[0]
    inverse, groups = _group_ids(name, index, bs, scores.device)
    n_groups = len(groups)
    counts, _, std = _group_stats(scores, inverse, n_groups)
    small = (counts < 2).nonzero().flatten().tolist()
    if small:
        ids = groups.tolist()  # plain Python ids, so the message shows 'uid' and not np.str_('uid')
        listed = ", ".join(f"{ids[g]!r} has {int(counts[g])}" for g in small[:5])
        raise ValueError(
            f"{name} needs at least 2 samples per group to compare the best with the second best; group "
            f"{listed}. Sample several responses per prompt (rollout.n >= 2) and keep them in one batch."
        )

    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    best = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, inverse, scores, "amax")  # R_max per group
    positions = torch.arange(bs, device=scores.device)
    first = torch.full((n_groups,), bs, dtype=torch.long, device=scores.device).scatter_reduce(
        0, inverse, torch.where(scores == best[inverse], positions, bs), "amin"
    )
    winner = positions == first[inverse]  # one best sample per group
    second = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    second = second.scatter_reduce(0, inverse, torch.where(winner, neg_inf, scores), "amax")  # R_second
    margin = best - second  # R_max − R_second
    if _setting(config, "norm_adv_by_std_in_grpo"):
        # A margin of 0 stays 0 even when std_g + ε is 0 (all scores tied, ε = 0).
        margin = torch.where(margin == 0, margin, margin / (std + _epsilon(config, extra)))
    advantages = _broadcast(torch.where(winner, margin[inverse], torch.zeros_like(scores)), mask)
    return advantages, advantages


@requires("groups")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al., 2024): the baseline is the mean of the *other* samples::

        A_i = R_i − (Σ_{j∈g, j≠i} R_j) / (n_g − 1) = n_g/(n_g − 1) · (R_i − mean_g)

    A group of one keeps A_i = R_i. A_i is put on every masked token; returns = advantages.

    Raises:
        ValueError: ``index`` is missing or not of length ``bs``.
    """
    name = "rloo"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    inverse, groups = _group_ids(name, index, scores.shape[0], scores.device)
    counts, mean, _ = _group_stats(scores, inverse, len(groups))
    n = counts[inverse]
    # mean is 0 for a group of one, and the factor n/(n−1) is replaced by 1 there: A_i = R_i.
    factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    advantages = _broadcast(factor * (scores - mean[inverse]), mask)  # n/(n−1)·(R_i − mean_g)
    return advantages, advantages


@requires("groups")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (on-policy RL with the optimal baseline): a length-weighted group mean as the baseline::

        b_g = Σ_{j∈g} |y_j|·R_j / Σ_{j∈g} |y_j|     (|y_j| = masked-in tokens of response j)
        A_i = R_i − b_g

    A group of one has b_g = 0 (A_i = R_i), as GRPO and RLOO treat it; a group whose responses are all
    empty has b_g = 0. A_i is put on every masked token; returns = advantages.

    Raises:
        ValueError: ``index`` is missing or not of length ``bs``.
    """
    name = "opo"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    lengths = mask.sum(dim=-1)  # |y_i|
    inverse, groups = _group_ids(name, index, scores.shape[0], scores.device)
    n_groups = len(groups)
    counts = _group_sum(torch.ones_like(scores), inverse, n_groups)
    weighted = _group_sum(lengths * scores, inverse, n_groups)  # Σ_j |y_j|·R_j
    total_length = _group_sum(lengths, inverse, n_groups)  # Σ_j |y_j|
    baseline = weighted / total_length.clamp(min=1)  # b_g
    baseline = torch.where(counts > 1, baseline, torch.zeros_like(baseline))
    advantages = _broadcast(scores - baseline[inverse], mask)  # A_i = R_i − b_g
    return advantages, advantages


@requires("groups")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (group policy gradient): the group mean as baseline, rescaled by how many samples scored::

        α   = bs / #{i : R_i ≠ 0}       (α = 1 when no sample has a nonzero score)
        A_i = α · (R_i − mean_g) / f_norm,   f_norm = 1

    A group of one has mean_g = 0. A_i is put on every masked token; returns = advantages.

    Raises:
        ValueError: ``index`` is missing or not of length ``bs``.
    """
    name = "gpg"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    bs = scores.shape[0]
    inverse, groups = _group_ids(name, index, bs, scores.device)
    _, mean, _ = _group_stats(scores, inverse, len(groups))
    nonzero = int(torch.count_nonzero(scores))
    alpha = bs / nonzero if nonzero > 0 else 1.0  # α = bs / #{R_i ≠ 0}
    f_norm = 1.0
    advantages = _broadcast(alpha * (scores - mean[inverse]) / f_norm, mask)  # α·(R_i − mean_g)/f_norm
    return advantages, advantages


# ---------------------------------------------------------------- REINFORCE family


@requires()
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted returns, whitened over the whole batch::

        G_t = m_t · (r_t + γ·G_{t+1})      (G_T = 0; m_t the mask)
        A   = whiten(G) over the masked tokens of the batch;  returns = G

    The return is reset at every masked-out token: G is 0 there and the recursion restarts from 0, so a
    reward after a tool-output hole does not reach the tokens before it (unlike ``gae``, which skips the
    hole). ``index`` is not used.
    """
    name = "reinforce_plus_plus"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    gamma = float(_setting(config, "gamma"))
    keep = mask.bool()
    zero = torch.zeros((), dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(token_level_rewards)
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(keep[:, t], token_level_rewards[:, t] + gamma * running, zero)  # G_t
        returns[:, t] = running
    advantages = torch.where(keep, masked_whiten(returns, mask), zero)
    return advantages, returns


@requires("groups")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline::

        s_i = R_i − mean_g                (mean_g = 0 for a group of one)
        A   = whiten(s_i on every masked token) over the masked tokens of the batch

    returns = advantages (the whitened scores, as verl returns them).

    Raises:
        ValueError: ``index`` is missing or not of length ``bs``.
    """
    name = "reinforce_plus_plus_baseline"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, axis=-1)  # R_i = Σ_t r_{i,t}
    inverse, groups = _group_ids(name, index, scores.shape[0], scores.device)
    _, mean, _ = _group_stats(scores, inverse, len(groups))
    centred = _broadcast(scores - mean[inverse], mask)  # s_i = R_i − mean_g on each token
    zero = torch.zeros((), dtype=centred.dtype, device=centred.device)
    advantages = torch.where(mask.bool(), masked_whiten(centred, mask), zero)
    return advantages, advantages


@requires("reward_baselines")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Any = None,
    config: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023): the greedy response's reward as the baseline.

    Needs ``reward_baselines`` ``(bs,)``: the reward of the greedy response to each sample's prompt::

        returns_t = Σ_{t' ≥ t} m_{t'}·r_{t'}      (undiscounted reward-to-go over the mask)
        A_t       = returns_t − b_i

    Both are zero outside the mask. ``index`` and γ are not used.

    Raises:
        ValueError: ``reward_baselines`` is missing or does not hold one value per sample.
    """
    name = "remax"
    mask = _check_inputs(name, token_level_rewards, response_mask)
    baselines = _required_extra(
        name, extra, "reward_baselines", "the reward of the greedy response to each prompt, (bs,)"
    )
    bs = token_level_rewards.shape[0]
    baselines = torch.as_tensor(baselines, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    if baselines.numel() != bs or baselines.dim() > 2:
        raise ValueError(
            f"{name}: reward_baselines must hold one value per sample, shape ({bs},); "
            f"got shape {tuple(baselines.shape)}."
        )
    zero = torch.zeros((), dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    masked_rewards = torch.where(mask.bool(), token_level_rewards, zero)  # m_t·r_t, NaN-safe
    returns = masked_rewards.flip(-1).cumsum(-1).flip(-1) * mask  # returns_t = Σ_{t'≥t} m·r
    advantages = (returns - baselines.reshape(bs, 1)) * mask  # A_t = returns_t − b_i
    return advantages, returns

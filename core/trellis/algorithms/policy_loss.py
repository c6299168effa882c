"""Policy losses (PPO and relatives), and the value and entropy losses.

Every policy loss follows the protocol of ``trellis.registries.policy_losses``::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None, global_batch_info=None, **needs) -> (loss, metrics)

- ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask``: ``(bs, T)`` over response
  tokens; ``log_prob`` carries the gradient, the others are treated as constants.
- ``rollout_is_weights``: optional ``(bs, T)`` importance weights (rollout correction); they
  multiply the per-token loss and are detached.
- ``global_batch_info``: the counts of the whole global mini-batch that the engine passes with each
  micro-batch (``dp_size``, ``batch_num_tokens``, ``global_batch_size``; see
  :mod:`trellis.algorithms.aggregation`); None means one rank and this call's own counts.
- ``loss``: a 0-d tensor, aggregated by :func:`trellis.algorithms.aggregation.agg_loss` with those
  counts.
- ``needs``: a loss may declare inputs it needs (``@requires("ref_log_prob")``, vocabulary in
  ``trellis.registries.NEEDS``); it is then called with them as keyword arguments.
- ``metrics``: detached 0-d tensors (no host synchronisation; ``float()`` them to log), at least
  ``actor/pg_clipfrac`` (fraction of masked tokens whose ratio was clipped, 0 for losses that
  never clip) and ``actor/ppo_kl`` (masked mean of old_log_prob − log_prob).

Settings come from ``config``: None, a dict, or a config object with ``.get(key, default)`` such
as ``ActorConfig``. A key is looked up first in ``config["policy_loss_kwargs"]`` (the loss-specific
settings), then in ``config`` itself; a missing key or a None value takes the default. The ratio
r = π/π_old is computed as exp(clamp(log π − log π_old, −20, 20)) so that it never overflows.

Registered names (entry points of ``trellis.policy_losses``): vanilla, gspo, gpg, clip_cov,
kl_cov, geo_mean, cispo, sapo.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trellis.algorithms.aggregation import GlobalBatchInfo, agg_loss
from trellis.algorithms.masked import masked_mean
from trellis.config.base import schema_default
from trellis.config.schema import ActorConfig
from trellis.utils.settings import config_value

LOG_RATIO_BOUND = 20.0
"""|log r| is clamped to this before exp: r stays within [e^-20, e^20]."""

Metrics = dict[str, torch.Tensor]


# ---------------------------------------------------------------- config and shared pieces


def _get(container: Any, key: str) -> Any:
    """``container[key]`` for a dict or anything with ``.get``; None when absent."""
    if container is not None and not callable(getattr(container, "get", None)):
        raise TypeError(
            f"config must be None, a dict or an object with .get(key, default) (like ActorConfig); "
            f"got a {type(container).__name__}."
        )
    return config_value(container, key, None)


def _setting(config: Any, key: str, default: Any) -> Any:
    """``key`` from ``config["policy_loss_kwargs"]``, else from ``config``, else ``default``."""
    value = _get(_get(config, "policy_loss_kwargs"), key)
    if value is None:
        value = _get(config, key)
    return default if value is None else value


def _clip_bounds(config: Any) -> tuple[float, float]:
    """(ε_low, ε_high): clip_ratio_low / clip_ratio_high, each defaulting to clip_ratio (0.2)."""
    clip_ratio = _setting(config, "clip_ratio", schema_default(ActorConfig, "clip_ratio"))
    return _setting(config, "clip_ratio_low", clip_ratio), _setting(config, "clip_ratio_high", clip_ratio)


def _global_batch_kwargs(info: GlobalBatchInfo | None) -> dict[str, Any]:
    """dp_size / batch_num_tokens / global_batch_size from ``global_batch_info`` (None: one rank, local
    counts)."""
    if info is not None and not isinstance(info, Mapping):
        raise TypeError(
            "global_batch_info must be a dict with dp_size, batch_num_tokens and global_batch_size (what "
            f"the engine passes to the loss function), got {type(info).__name__}."
        )
    info = info or {}
    return {
        "dp_size": info.get("dp_size") or 1,
        "batch_num_tokens": info.get("batch_num_tokens"),
        "global_batch_size": info.get("global_batch_size"),
    }


def _aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    global_batch_info: GlobalBatchInfo | None,
) -> torch.Tensor:
    return agg_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        loss_scale_factor=_setting(config, "loss_scale_factor", None),
        **_global_batch_kwargs(global_batch_info),
    )


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    # log r = log π − log π_old, clamped so exp never overflows
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _weighted(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of masked-in tokens where ``condition`` holds (detached)."""
    return masked_mean(condition.detach().to(torch.float32), mask)


def _base_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, clipfrac: torch.Tensor | float) -> Metrics:
    clipfrac = torch.as_tensor(clipfrac, dtype=torch.float32, device=log_ratio.device)
    # ppo_kl ≈ E[log π_old − log π] (k1 estimate of KL(π_old || π))
    return {"actor/pg_clipfrac": clipfrac.detach(), "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask)}


def _ppo_clip(
    advantages: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped PPO loss max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), and where clipping bound."""
    pg_losses1 = -advantages * ratio  # −A·r
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # −A·clip(r)
    return torch.maximum(pg_losses1, pg_losses2), pg_losses2 > pg_losses1


def _selection_size(name: str, ratio: float, n_masked: int) -> int:
    """How many of ``n_masked`` tokens a fraction ``ratio`` selects: ⌊ratio·n⌋, at least 1 when ratio > 0."""
    if ratio < 0 or ratio > 1:
        raise ValueError(f"{name}={ratio!r} must lie in [0, 1]: it is a fraction of the masked tokens.")
    return 0 if ratio == 0 or n_masked == 0 else max(1, int(ratio * n_masked))


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred cross term (A − mean A)·(log π − mean log π), means over masked tokens (detached)."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


# ---------------------------------------------------------------- policy losses


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped PPO with asymmetric clip bounds and dual clip for negative advantages.

    Per token (r = π/π_old):
        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))
        L = min(L, −A·c)  where A < 0   (dual clip: caps the loss of a very large ratio at c·|A|)

    Settings: clip_ratio (0.2), clip_ratio_low / clip_ratio_high (default clip_ratio),
    clip_ratio_c (3.0). Metrics: actor/pg_clipfrac, actor/pg_clipfrac_lower (tokens where the dual
    clip bound acts), actor/ppo_kl.

    Raises:
        ValueError: clip_ratio_c <= 1.
    """
    clip_low, clip_high = _clip_bounds(config)
    clip_c = _setting(config, "clip_ratio_c", schema_default(ActorConfig, "clip_ratio_c"))
    if clip_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c={clip_c!r}: the dual-clip bound must be > 1 (3.0 is usual); below 1 it would "
            "clip ratios the ordinary PPO clip already allows."
        )
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clip_losses1, clipped = _ppo_clip(advantages, ratio, clip_low, clip_high)
    pg_losses3 = -advantages * clip_c  # −A·c: the dual-clip cap (positive for A < 0)
    clip_losses2 = torch.minimum(pg_losses3, clip_losses1)
    negative = advantages < 0
    pg_losses = torch.where(negative, clip_losses2, clip_losses1)
    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    metrics = _base_metrics(log_ratio, response_mask, _fraction(clipped, response_mask))
    metrics["actor/pg_clipfrac_lower"] = _fraction((clip_losses1 > pg_losses3) & negative, response_mask)
    return loss, metrics


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Group Sequence Policy Optimization): PPO clip on a sequence-level ratio.

    s_i = exp(mean_t log r_{i,t}) over the sequence's masked tokens (the geometric mean of its
    token ratios), applied token-wise as s_{i,t} = sg(s_i)·π_t/sg(π_t): its value is s_i, its
    gradient flows through each token's log π. Then per token
        L = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − ε_low, 1 + ε_high)).

    Settings: clip_ratio_low / clip_ratio_high (GSPO uses tiny values such as 3e-4 / 4e-4 —
    set them in policy_loss_kwargs or on the actor; the generic default 0.2 applies otherwise).
    The loss is aggregated by ``loss_agg_mode``, as verl 0.9.1 does; the paper's aggregation is
    ``seq-mean-token-mean`` (every sequence weighs the same): set it with GSPO.
    """
    clip_low, clip_high = _clip_bounds(config)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1).detach()  # log s_i = mean_t log r_t
    # log s_{i,t} = log π_t − sg(log π_t) + sg(log s_i)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1)
    seq_ratio = torch.exp(token_log_ratio)
    pg_losses, clipped = _ppo_clip(advantages, seq_ratio, clip_low, clip_high)
    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    return loss, _base_metrics(log_ratio, response_mask, _fraction(clipped, response_mask))


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Group Policy Gradient): plain REINFORCE, L = −A·log π per token; no ratio, no clip.

    ``old_log_prob`` only feeds the actor/ppo_kl metric.
    """
    pg_losses = -advantages * log_prob  # −A·log π
    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    return loss, _base_metrics(_log_ratio(old_log_prob, log_prob), response_mask, 0.0)


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    PPO clip (ε_low / ε_high, no dual clip), except that tokens with a high covariance term
        cov_t = (A_t − mean A)·(log π_t − mean log π)        (means over the masked tokens)
    lose their gradient: among masked tokens with clip_cov_lb <= cov_t <= clip_cov_ub, a random
    ⌊clip_cov_ratio·N⌋ (at least 1 when the ratio is > 0) of the N masked tokens are detached.
    Such tokens drive the collapse of entropy; removing their gradient slows it.

    Settings (policy_loss_kwargs): clip_cov_ratio (2e-4), clip_cov_lb (1.0), clip_cov_ub (5.0),
    seed (None). With a seed the choice uses a fresh ``torch.Generator`` seeded with it, so the
    same inputs detach the same tokens (reproducible tests); without one it draws from torch's
    global RNG. Means are over this call's tokens (the micro-batch). Metrics add
    actor/clip_cov_frac (fraction of masked tokens detached).
    """
    clip_low, clip_high = _clip_bounds(config)
    cov_ratio = _setting(config, "clip_cov_ratio", 2e-4)
    cov_lb = _setting(config, "clip_cov_lb", 1.0)
    cov_ub = _setting(config, "clip_cov_ub", 5.0)
    seed = _setting(config, "seed", None)

    log_ratio = _log_ratio(old_log_prob, log_prob)
    pg_losses, clipped = _ppo_clip(advantages, torch.exp(log_ratio), clip_low, clip_high)

    cov = _token_covariance(advantages, log_prob, response_mask)
    candidates = response_mask.bool() & (cov >= cov_lb) & (cov <= cov_ub)
    candidate_idx = candidates.flatten().nonzero().squeeze(-1)
    n_detach = min(
        candidate_idx.numel(), _selection_size("clip_cov_ratio", cov_ratio, int(response_mask.bool().sum()))
    )
    generator = None if seed is None else torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(candidate_idx.numel(), generator=generator)[:n_detach]
    detached = torch.zeros(pg_losses.numel(), dtype=torch.bool, device=pg_losses.device)
    detached[candidate_idx[pick.to(candidate_idx.device)]] = True
    detached = detached.view_as(pg_losses)
    pg_losses = torch.where(detached, pg_losses.detach(), pg_losses)  # same value, no gradient

    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    metrics = _base_metrics(log_ratio, response_mask, _fraction(clipped, response_mask))
    metrics["actor/clip_cov_frac"] = _fraction(detached, response_mask)
    return loss, metrics


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025): unclipped policy gradient plus a KL penalty on high-covariance tokens.

    Per token L = −A·r, and for the ⌊kl_cov_ratio·N⌋ (at least 1 when the ratio is > 0) masked
    tokens with the largest cov_t = (A_t − mean A)·(log π_t − mean log π) (means over the masked
    tokens) L += ppo_kl_coef·|log r|.

    Settings (policy_loss_kwargs): kl_cov_ratio (2e-3), ppo_kl_coef (1.0). Metrics add
    actor/kl_cov_frac (fraction of masked tokens penalised); actor/pg_clipfrac is 0.
    """
    cov_ratio = _setting(config, "kl_cov_ratio", 2e-3)
    kl_coef = _setting(config, "ppo_kl_coef", 1.0)

    log_ratio = _log_ratio(old_log_prob, log_prob)
    pg_losses = -advantages * torch.exp(log_ratio)  # −A·r

    mask = response_mask.bool()
    cov = _token_covariance(advantages, log_prob, response_mask)
    n_penalised = _selection_size("kl_cov_ratio", cov_ratio, int(mask.sum()))
    scores = torch.where(mask, cov, torch.full_like(cov, float("-inf"))).flatten()
    penalised = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    penalised[torch.topk(scores, n_penalised).indices] = True
    penalised = penalised.view_as(pg_losses)
    # L += β·|log r| on the top-covariance tokens
    pg_losses = torch.where(penalised, pg_losses + kl_coef * log_ratio.abs(), pg_losses)

    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    metrics = _base_metrics(log_ratio, response_mask, 0.0)
    metrics["actor/kl_cov_frac"] = _fraction(penalised, response_mask)
    return loss, metrics


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Geometric-Mean Policy Optimization): the geometric mean of token ratios per sequence.

    With A_i the sequence advantage (masked mean of its token advantages), per token the log
    ratio is clipped in log space, sign-aware (GMPO's min(r^sgn A, clip(r)^sgn A)):
        A_i >= 0: ℓ_t = min(log r_t, ε_high)       (only the upper bound acts)
        A_i <  0: ℓ_t = max(log r_t, −ε_low)       (only the lower bound acts)
    and L_i = −A_i · exp(mean_t ℓ_t); the loss is the mean of L_i over non-empty sequences (over
    the global batch, as in ``seq-mean-token-sum`` on one entry per sequence), whatever
    ``loss_agg_mode`` says. Note ε is a log-space bound: the default 0.2 allows r in
    [e^-0.2, e^0.2]; GMPO uses 0.4.

    ``rollout_is_weights`` enter the product like the ratios do: L_i is multiplied by the geometric
    mean of its tokens' weights (a zero weight zeroes the sequence). Metrics: actor/pg_clipfrac
    counts tokens whose log ratio was clipped.
    """
    del loss_agg_mode  # GMPO defines its own aggregation (see docstring)
    clip_low, clip_high = _clip_bounds(config)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    seq_adv = masked_mean(advantages, response_mask, axis=-1)  # A_i
    positive = (seq_adv >= 0).unsqueeze(-1)
    clipped_log_ratio = torch.where(
        positive, log_ratio.clamp(max=clip_high), log_ratio.clamp(min=-clip_low)
    )  # ℓ_t
    clipped = torch.where(positive, log_ratio > clip_high, log_ratio < -clip_low)
    geo_ratio = torch.exp(masked_mean(clipped_log_ratio, response_mask, axis=-1))  # exp(mean_t ℓ_t)
    seq_losses = -seq_adv * geo_ratio  # L_i = −A_i·(Π_t r_t)^(1/|o_i|)
    if rollout_is_weights is not None:
        # × (Π_t w_t)^(1/|o_i|)
        seq_losses = seq_losses * torch.exp(
            masked_mean(torch.log(rollout_is_weights.detach()), response_mask, axis=-1)
        )
    non_empty = response_mask.bool().any(dim=-1)
    loss = agg_loss(
        seq_losses.unsqueeze(-1),
        non_empty.unsqueeze(-1),
        "seq-mean-token-sum",
        **_global_batch_kwargs(global_batch_info),
    )
    return loss, _base_metrics(log_ratio, response_mask, _fraction(clipped, response_mask))


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1): clip the importance weight, never the gradient.

    Per token L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π: every token keeps a REINFORCE
    gradient, scaled by its clipped (detached) ratio. Settings: clip_ratio_low / clip_ratio_high.
    actor/pg_clipfrac counts tokens whose ratio lay outside the range.
    """
    clip_low, clip_high = _clip_bounds(config)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # sg(clip(r))
    pg_losses = -weight * advantages * log_prob  # −sg(clip(r))·A·log π
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config, global_batch_info
    )
    return loss, _base_metrics(log_ratio, response_mask, _fraction(clipped, response_mask))


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Soft Adaptive Policy Optimization): a smooth gate instead of the hard clip.

    Per token f(r) = σ(τ·(r − 1))·4/τ and L = −f(r)·A, with τ = tau_pos for A > 0 and tau_neg
    otherwise. f(1) = 2/τ and f'(r) = 4·σ(1 − σ), which is 1 at r = 1 (the on-policy gradient is
    PPO's) and decays smoothly as r leaves 1; a larger τ decays faster.

    Settings (policy_loss_kwargs): tau_pos (1.0), tau_neg (1.05). actor/pg_clipfrac is 0.
    The loss is always aggregated ``seq-mean-token-mean``, whatever ``loss_agg_mode`` says, as
    verl 0.9.1 does.

    Raises:
        ValueError: tau_pos or tau_neg <= 0.
    """
    tau_pos = _setting(config, "tau_pos", 1.0)
    tau_neg = _setting(config, "tau_neg", 1.05)
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if tau <= 0:
            raise ValueError(f"sapo: {name}={tau!r} must be > 0 (defaults: tau_pos 1.0, tau_neg 1.05).")
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # f(r) = σ(τ(r − 1))·4/τ
    pg_losses = -gate * advantages  # −f(r)·A
    del loss_agg_mode  # SAPO's own aggregation (see docstring)
    loss = _aggregate(
        _weighted(pg_losses, rollout_is_weights),
        response_mask,
        "seq-mean-token-mean",
        config,
        global_batch_info,
    )
    return loss, _base_metrics(log_ratio, response_mask, 0.0)


# ---------------------------------------------------------------- value and entropy losses


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss: per token 0.5·max((v − R)², (V + clip(v − V, −c, c) − R)²).

    Args:
        vpreds: ``(bs, T)`` values v of the critic being trained (carry the gradient).
        returns: ``(bs, T)`` targets R.
        values: ``(bs, T)`` values V predicted at rollout time (old critic).
        response_mask: ``(bs, T)``.
        cliprange_value: c, how far v may move from V before its gradient is cut.
        loss_agg_mode, config, global_batch_info: as for the policy losses.

    Returns:
        (loss, metrics) with ``critic/vf_clipfrac``: fraction of masked tokens where the clipped
        term is the larger one.

    Raises:
        ValueError: cliprange_value <= 0.
    """
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value={cliprange_value!r} must be > 0 (0.5 is common).")
    vpred_clipped = values + torch.clamp(
        vpreds - values, -cliprange_value, cliprange_value
    )  # V + clip(v − V)
    vf_losses1 = (vpreds - returns) ** 2  # (v − R)²
    vf_losses2 = (vpred_clipped - returns) ** 2  # (v_clip − R)²
    vf_losses = 0.5 * torch.maximum(vf_losses1, vf_losses2)
    loss = _aggregate(vf_losses, response_mask, loss_agg_mode, config, global_batch_info)
    return loss, {"critic/vf_clipfrac": _fraction(vf_losses2 > vf_losses1, response_mask)}


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    global_batch_info: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """The per-token entropy ``(bs, T)`` (computed by the engine) aggregated to a scalar.

    This is the entropy itself, not its negative: the actor loss subtracts ``entropy_coeff`` × it
    from the policy loss. ``global_batch_info`` as for the losses.
    """
    return _aggregate(entropy, response_mask, loss_agg_mode, config, global_batch_info)

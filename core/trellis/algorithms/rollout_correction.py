"""Rollout correction: importance weights and rejection for the mismatch between the rollout
backend's token probabilities and the trainer's.

The rollout engine (vllm, sglang, ...) samples y_t ~ π_rollout, but the loss is computed under
π_train, whose numerics differ (kernels, precision, batch shapes). Per response token

    log ρ_t = log π_train(y_t) − log π_rollout(y_t)        (old_log_prob − rollout_log_prob)

measures that mismatch. This module turns it into

- importance weights (``rollout_is``): ``token`` w_t = ρ_t, or ``sequence`` w = Π_t ρ_t on every
  token of a response; truncated at a threshold C (w = min(w, C), truncated IS) or zeroed
  outside a band [lower, upper] (IcePop); optionally rescaled to mean 1 over the batch;
- rejection (``rollout_rs``): tokens or whole responses whose divergence exceeds a threshold
  leave the loss mask;
- diagnostics: KL estimates, perplexity ratio, χ², what was rejected, truncated or zeroed.

Divergences are estimators of KL(π_rollout ‖ π_train) from samples of π_rollout (Schulman's
k1/k2/k3 with r = ρ):

    k1_t = −log ρ_t = log π_rollout − log π_train      (signed; thresholds bound |k1|)
    k2_t = ½ (log ρ_t)²                                 (≥ 0)
    k3_t = ρ_t − 1 − log ρ_t                             (≥ 0)

Rejection criteria are ``token_kN`` (a token is rejected when its |kN_t| > threshold) and
``seq_{sum,mean,max}_kN`` (a response is rejected when |Σ_t kN_t|, |mean_t kN_t| or max_t |kN_t|
over its tokens exceeds the threshold; for k1 the sum and mean are of the signed values, so
``seq_sum_k1`` bounds the response's log-ratio |log Π_t ρ_t|). Criteria are joined by commas and
each is judged on the original ``response_mask``; a token is kept only if every criterion keeps it.

Weights are computed after rejection: they are 0 wherever the returned mask is 0, and batch
normalisation and the weight metrics run over what is kept. Log-ratios are clamped to ±20
before ``exp`` (e^20 ≈ 5·10⁸, far beyond any sensible threshold) so nothing overflows. The
option grammar (criteria names, threshold forms) is parsed by
:class:`trellis.config.RolloutCorrectionConfig`, so config and function accept the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trellis.algorithms.masked import masked_mean, masked_sum
from trellis.config.schema import RolloutCorrectionConfig

LOG_RATIO_BOUND = 20.0
"""|log ρ| (per token, and per response for sequence weights) is clamped to this before ``exp``."""

METRIC_PREFIX = "rollout_corr/"

IsThreshold = float | str | tuple[float, float] | list[float] | None
RsThreshold = float | str | list[float] | tuple[float, ...] | None


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: IsThreshold = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: RsThreshold = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Importance weights, the loss mask after rejection, and mismatch metrics.

    Args:
        old_log_prob: ``(bs, T)`` log π_train of the sampled tokens (the trainer's recomputation).
        rollout_log_prob: ``(bs, T)`` log π_rollout of the same tokens (from the rollout engine).
        response_mask: ``(bs, T)`` 1 (or True) on tokens the policy generated, 0 elsewhere; any
            dtype. Values outside it (padding) are never read, even NaN or inf.
        rollout_is: ``None`` (no weights), ``"token"`` (w_t = ρ_t) or ``"sequence"``
            (w = exp(Σ_t log ρ_t) on each token of the response).
        rollout_is_threshold: a number C truncates: w = min(w, C). A band ``"lower_upper"``
            (``"0.5_2.0"``) or ``(lower, upper)`` zeroes weights outside [lower, upper]. ``None``:
            neither. Ignored when ``rollout_is`` is None.
        rollout_is_batch_normalize: divide the weights by their mean over the kept tokens
            (``token``) or kept responses (``sequence``), so that mean becomes 1. Skipped when
            that mean is 0 (everything zeroed).
        rollout_rs: rejection criteria joined by commas, e.g. ``"token_k1"`` or
            ``"seq_mean_k3,seq_max_k1"`` (see the module docstring); ``None``: reject nothing.
        rollout_rs_threshold: thresholds > 0: one number for all criteria, or one per criterion
            as a comma-separated string or a list. Required with ``rollout_rs``.

    Returns:
        ``(weights, new_mask, metrics)``: ``weights`` ``(bs, T)`` float, detached, 0 outside
        ``new_mask`` (``None`` when ``rollout_is`` is None); ``new_mask`` ``(bs, T)`` is
        ``response_mask`` with rejected tokens and responses set to 0, in its dtype; ``metrics``
        maps ``rollout_corr/...`` names to Python floats:

        - ``kl_k1``, ``kl_k2``, ``kl_k3``: token means of k1, k2, k3 (KL(π_rollout ‖ π_train) estimates);
        - ``ppl_train``, ``ppl_rollout``: exp(mean token NLL) under each;
          ``ppl_ratio`` = ppl_train / ppl_rollout;
        - ``chi2_token``: mean_t (ρ_t² − 1); ``chi2_seq``: mean over responses of (Π_t ρ_t)² − 1;
        - ``rejected_token_frac``: share of response tokens removed from the mask;
          ``rejected_seq_frac``: share of responses left with no token;
        - ``rs_<criterion>_frac`` (with ``rollout_rs``): share of tokens (token criteria) or
          responses (sequence criteria) that criterion rejects on its own;
        - with ``rollout_is``: ``is_weight_mean``/``max``/``min`` of the final weights over kept
          tokens (``token``) or kept responses (``sequence``), and ``is_truncated_frac``
          (truncation) or ``is_zeroed_frac`` (band): the share of those weights it changed.

    Raises:
        ValueError: tensors not 2-D or of different shapes; a ``response_mask`` selecting no
            token; an unknown ``rollout_is`` or rejection criterion; a threshold not > 0, a band
            with lower >= upper, or a threshold count not matching the criteria; batch
            normalisation without ``rollout_is``.
    """
    _check_shapes(old_log_prob, rollout_log_prob, response_mask)
    valid = response_mask.bool()
    if not valid.any():
        raise ValueError(
            f"response_mask of shape {tuple(response_mask.shape)} selects no token; there is nothing to "
            "correct. Leave empty batches out before calling compute_rollout_correction_and_rejection_mask."
        )
    if rollout_is is not None and rollout_is not in RolloutCorrectionConfig.IS_LEVELS:
        raise ValueError(
            f"rollout_is must be one of None, 'token', 'sequence'; got {rollout_is!r}. 'token' weighs each "
            "token by its own ratio, 'sequence' each response by the product of its tokens' ratios."
        )
    band = RolloutCorrectionConfig.parse_is_threshold(rollout_is_threshold)
    if rollout_is_batch_normalize and rollout_is is None:
        raise ValueError(
            "rollout_is_batch_normalize is True but rollout_is is None: there are no weights to normalise. "
            "Set rollout_is='token' or 'sequence', or rollout_is_batch_normalize=False."
        )
    criteria: list[str] = []
    thresholds: list[float] = []
    if rollout_rs is not None:
        criteria = RolloutCorrectionConfig.parse_rs(rollout_rs)
        thresholds = RolloutCorrectionConfig.parse_rs_thresholds(
            rollout_rs_threshold, criteria, rs_spec=rollout_rs
        )

    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    old = old_log_prob.detach().to(dtype)
    rollout = rollout_log_prob.detach().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=old.device)
    # log ρ_t = log π_train − log π_rollout, 0 on padding (where may hold NaN/inf), clamped for exp
    log_ratio = torch.where(valid, old - rollout, zero).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    divergences = {
        "k1": -log_ratio,  # k1 = log π_rollout − log π_train
        "k2": 0.5 * log_ratio**2,  # k2 = ½ (log ρ)²
        "k3": torch.expm1(log_ratio) - log_ratio,  # k3 = ρ − 1 − log ρ  (expm1: exact near ρ = 1)
    }
    has_tokens = valid.any(dim=-1)  # (bs,) responses with at least one token

    metrics = _mismatch_metrics(old, rollout, log_ratio, divergences, valid, has_tokens)

    keep = valid.clone()
    for criterion, threshold in zip(criteria, thresholds, strict=True):
        rejected, share = _reject(criterion, threshold, divergences, valid, has_tokens)
        keep &= ~rejected
        metrics[f"rs_{criterion}_frac"] = share
    new_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    kept_responses = keep.any(dim=-1)
    metrics["rejected_token_frac"] = 1.0 - keep.sum().item() / valid.sum().item()
    metrics["rejected_seq_frac"] = (has_tokens & ~kept_responses).sum().item() / has_tokens.sum().item()

    weights = None
    if rollout_is is not None:
        weights, is_metrics = _importance_weights(
            rollout_is, band, rollout_is_batch_normalize, log_ratio, keep, kept_responses
        )
        metrics.update(is_metrics)
    return weights, new_mask, {METRIC_PREFIX + name: float(value) for name, value in metrics.items()}


def rollout_correction_from_config(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """:func:`compute_rollout_correction_and_rejection_mask` with its options read from ``config``.

    ``config`` is a :class:`~trellis.config.RolloutCorrectionConfig`, an ``AlgorithmConfig`` (its
    ``rollout_correction`` is used), or a mapping of ``RolloutCorrectionConfig``'s fields (missing
    ones take their defaults; a mapping holding a ``rollout_correction`` key is read there).

    Raises:
        ValueError: everything the function raises; a mapping with unknown keys, or values that
            do not fit the config (a ``ConfigValueError``); a ``config`` of another kind.
    """
    correction = _as_config(config)
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        rollout_is=correction.rollout_is,
        rollout_is_threshold=correction.rollout_is_threshold,
        rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
        rollout_rs=correction.rollout_rs,
        rollout_rs_threshold=correction.rollout_rs_threshold,
    )


# ---------------------------------------------------------------- the parts


def _mismatch_metrics(
    old: torch.Tensor,
    rollout: torch.Tensor,
    log_ratio: torch.Tensor,
    divergences: dict[str, torch.Tensor],
    valid: torch.Tensor,
    has_tokens: torch.Tensor,
) -> dict[str, float]:
    metrics = {f"kl_{name}": masked_mean(values, valid).item() for name, values in divergences.items()}
    # float64: exp of a mean NLL of a few hundred nats still fits
    nll_train = masked_mean(-old.double(), valid)  # mean token NLL under π_train
    nll_rollout = masked_mean(-rollout.double(), valid)
    metrics["ppl_train"] = torch.exp(nll_train).item()  # ppl = exp(mean NLL)
    metrics["ppl_rollout"] = torch.exp(nll_rollout).item()
    metrics["ppl_ratio"] = torch.exp(nll_train - nll_rollout).item()  # ppl_train / ppl_rollout, overflow-safe
    metrics["chi2_token"] = masked_mean(torch.expm1(2 * log_ratio), valid).item()  # E[ρ²] − 1
    seq_log_ratio = masked_sum(log_ratio, valid, axis=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics["chi2_seq"] = masked_mean(torch.expm1(2 * seq_log_ratio), has_tokens).item()  # E[(Π ρ)²] − 1
    return metrics


def _reject(
    criterion: str,
    threshold: float,
    divergences: dict[str, torch.Tensor],
    valid: torch.Tensor,
    has_tokens: torch.Tensor,
) -> tuple[torch.Tensor, float]:
    """``(bs, T)`` True on the tokens ``criterion`` rejects, and the share of its units rejected."""
    *level, divergence = criterion.split("_")  # "token_k1" / "seq_mean_k3"
    values = divergences[divergence]
    if level == ["token"]:
        rejected = valid & (values.abs() > threshold)  # |k_t| > τ
        return rejected, rejected.sum().item() / valid.sum().item()
    aggregate = level[1]
    if aggregate == "sum":
        statistic = masked_sum(values, valid, axis=-1).abs()  # |Σ_t k_t|
    elif aggregate == "mean":
        statistic = masked_mean(values, valid, axis=-1).abs()  # |Σ_t k_t / n|
    else:
        statistic = torch.where(valid, values.abs(), torch.zeros_like(values)).amax(dim=-1)  # max_t |k_t|
    rejected_responses = has_tokens & (statistic > threshold)
    share = rejected_responses.sum().item() / has_tokens.sum().item()
    return valid & rejected_responses.unsqueeze(-1), share


def _importance_weights(
    level: str,
    band: tuple[float | None, float | None],
    batch_normalize: bool,
    log_ratio: torch.Tensor,
    keep: torch.Tensor,
    kept_responses: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(bs, T)`` weights, 0 outside ``keep``, and their metrics."""
    if level == "token":
        raw = torch.exp(log_ratio)  # w_t = ρ_t
        units = keep
    else:
        seq_log_ratio = masked_sum(log_ratio, keep, axis=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        raw = torch.exp(seq_log_ratio)  # w = Π_t ρ_t = exp(Σ_t log ρ_t), one per response
        units = kept_responses
    lower, upper = band
    metrics: dict[str, float] = {}
    if lower is not None and upper is not None:  # IcePop band: w = ρ if lower <= ρ <= upper else 0
        inside = (raw >= lower) & (raw <= upper)
        metrics["is_zeroed_frac"] = masked_mean((~inside).to(raw.dtype), units).item()
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    elif upper is not None:  # truncated IS: w = min(ρ, C)
        metrics["is_truncated_frac"] = masked_mean((raw > upper).to(raw.dtype), units).item()
        weights = raw.clamp(max=upper)
    else:
        weights = raw
    if batch_normalize:
        mean = masked_mean(weights, units)
        if mean > 0:
            weights = weights / mean  # w ← w / mean_batch(w), so the mean becomes 1
    weights = torch.where(units, weights, torch.zeros_like(weights))
    selected = weights[units]
    metrics["is_weight_mean"] = masked_mean(weights, units).item()
    metrics["is_weight_max"] = selected.max().item() if selected.numel() else 0.0
    metrics["is_weight_min"] = selected.min().item() if selected.numel() else 0.0
    if level == "sequence":
        weights = torch.where(keep, weights.unsqueeze(-1), torch.zeros_like(weights).unsqueeze(-1))
    return weights, metrics


def _check_shapes(old_log_prob: Any, rollout_log_prob: Any, response_mask: Any) -> None:
    named = {
        "old_log_prob": old_log_prob,
        "rollout_log_prob": rollout_log_prob,
        "response_mask": response_mask,
    }
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor of shape (bs, T); got a {type(tensor).__name__}."
            )
        if tensor.dim() != 2:
            raise ValueError(
                f"{name} must have shape (bs, T) (2 dimensions); got shape {tuple(tensor.shape)}. "
                "Pass response tokens only, one row per response."
            )
    for name in ("rollout_log_prob", "response_mask"):
        if named[name].shape != old_log_prob.shape:
            raise ValueError(
                f"{name} has shape {tuple(named[name].shape)} but old_log_prob has shape "
                f"{tuple(old_log_prob.shape)}; both must be (bs, T) over the same response tokens."
            )


def _as_config(config: Any) -> RolloutCorrectionConfig:
    if isinstance(config, RolloutCorrectionConfig):
        return config
    nested = getattr(config, "rollout_correction", None)
    if isinstance(nested, RolloutCorrectionConfig):
        return nested
    if isinstance(config, Mapping):
        fields = dict(config.get("rollout_correction", config))
        known = RolloutCorrectionConfig().keys()
        unknown = sorted(str(key) for key in fields if key not in known)
        if unknown:
            raise ValueError(
                f"Rollout correction config has unknown keys {unknown}; the keys are {', '.join(known)}."
            )
        return RolloutCorrectionConfig(**fields)
    raise ValueError(
        "config must be a RolloutCorrectionConfig, an AlgorithmConfig or a mapping of rollout correction "
        f"options; got a {type(config).__name__}."
    )

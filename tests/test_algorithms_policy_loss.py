"""trellis.algorithms.policy_loss: the policy losses, the value loss and the entropy loss.

Hand cases are 2 sequences × 3 tokens unless said otherwise; the last token of sequence 1 is
padding (mask 0) and holds values that would change the result if they leaked in. Ratios are set
through old_log_prob = log_prob − log r.
"""

from __future__ import annotations

import math

import pytest
import torch

import trellis.registries
from trellis.algorithms import policy_loss as pl
from trellis.config.schema import ActorConfig

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
NAMES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo")


def _log_probs(ratio, log_prob=None):
    """(old_log_prob, log_prob) with π/π_old = ratio; log_prob is a leaf that records its gradient."""
    ratio = torch.tensor(ratio, dtype=torch.float64)
    log_prob = (
        torch.full_like(ratio, -1.0) if log_prob is None else torch.tensor(log_prob, dtype=torch.float64)
    )
    return log_prob - torch.log(ratio), log_prob.requires_grad_(True)


def _grad(loss, log_prob):
    (grad,) = torch.autograd.grad(loss, log_prob)
    return grad


def _approx(value, expected):
    assert float(torch.as_tensor(value).detach()) == pytest.approx(expected, abs=1e-6)


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- vanilla

VANILLA_RATIO = [[1.1, 1.5, 0.5], [5.0, 0.7, 9.0]]
VANILLA_ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 2.0]], dtype=torch.float64)


def test_vanilla_hand_case_and_gradient():
    old, new = _log_probs(VANILLA_RATIO)
    loss, metrics = pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK)
    # ε = 0.2, c = 3; per token max(−A·r, −A·clip(r, 0.8, 1.2)), then min(·, 3·|A|) for A < 0:
    #   (0,0) A=+1 r=1.1: max(−1.1, −1.1) = −1.1
    #   (0,1) A=+1 r=1.5: max(−1.5, −1.2) = −1.2   clipped
    #   (0,2) A=−1 r=0.5: max( 0.5,  0.8) =  0.8   clipped
    #   (1,0) A=−1 r=5.0: max( 5.0,  1.2) =  5.0 → min(3, 5) = 3   dual clip
    #   (1,1) A=−1 r=0.7: max( 0.7,  0.8) =  0.8   clipped
    # token-mean: (−1.1 − 1.2 + 0.8 + 3 + 0.8) / 5 = 2.3 / 5
    _approx(loss, 0.46)
    _approx(metrics["actor/pg_clipfrac"], 3 / 5)
    _approx(metrics["actor/pg_clipfrac_lower"], 1 / 5)
    _approx(metrics["actor/ppo_kl"], -math.log(1.1 * 1.5 * 0.5 * 5.0 * 0.7) / 5)  # mean of −log r
    # only the unclipped token has a gradient: d(−A·r)/d log π = −A·r = −1.1, over 5 tokens
    _close(_grad(loss, new), [[-0.22, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_vanilla_dual_clip_caps_a_very_negative_advantage_with_a_large_ratio():
    old, new = _log_probs([[50.0]])
    loss, metrics = pl.compute_policy_loss_vanilla(old, new, torch.tensor([[-10.0]]), torch.tensor([[1]]))
    _approx(loss, 30.0)  # −A·c = 10·3, instead of −A·r = 500
    _approx(metrics["actor/pg_clipfrac_lower"], 1.0)
    _approx(_grad(loss, new).item(), 0.0)
    with pytest.raises(ValueError, match=r"clip_ratio_c=1.0: the dual-clip bound must be > 1"):
        pl.compute_policy_loss_vanilla(
            old, new, torch.tensor([[-10.0]]), torch.tensor([[1]]), config={"clip_ratio_c": 1.0}
        )


def test_vanilla_reads_asymmetric_clip_bounds_from_a_config_object_or_dict():
    old, new = _log_probs(VANILLA_RATIO)
    # ε_high = 0.6: token (0,1) r = 1.5 is no longer clipped: (−1.1 − 1.5 + 0.8 + 3 + 0.8) / 5 = 2.0 / 5
    for config in (
        ActorConfig(clip_ratio_high=0.6),
        {"clip_ratio_high": 0.6},
        {"policy_loss_kwargs": {"clip_ratio_high": 0.6}},
    ):
        loss, metrics = pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, config=config)
        _approx(loss, 0.4)
        _approx(metrics["actor/pg_clipfrac"], 2 / 5)


def test_vanilla_rollout_is_weights_multiply_the_per_token_loss():
    old, new = _log_probs(VANILLA_RATIO)
    weights = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 7.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, rollout_is_weights=weights)
    _approx(loss, (-1.1 * 2 - 1.2 + 0.8 + 3.0 + 0.8 * 0.5) / 5)  # 0.8 / 5
    loss.backward()
    assert weights.grad is None  # the weights are constants


def test_global_batch_info_is_an_explicit_argument_that_sets_the_normalisation():
    old, new = _log_probs(VANILLA_RATIO)
    info = {"dp_size": 2, "batch_num_tokens": 20, "global_batch_size": 8}
    loss, _ = pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, global_batch_info=info)
    _approx(loss, 2.3 / 20 * 2)
    loss, _ = pl.compute_policy_loss_vanilla(
        old, new, VANILLA_ADV, MASK, "seq-mean-token-sum", global_batch_info=info
    )
    _approx(loss, (-1.5 + 3.8) / 8 * 2)  # sequence sums (−1.1 − 1.2 + 0.8) and (3 + 0.8)
    with pytest.raises(ValueError, match="pass batch_num_tokens="):
        pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, global_batch_info={"dp_size": 2})
    # nothing is dug out of the config any more: counts there are not counts
    loss, _ = pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, config={"global_batch_info": info})
    _approx(loss, 2.3 / 5)
    with pytest.raises(TypeError, match="global_batch_info must be a dict with dp_size"):
        pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, global_batch_info=[2, 20, 8])


# ---------------------------------------------------------------- gspo


def test_gspo_hand_case_uses_the_sequence_ratio_and_honours_loss_agg_mode():
    """verl 0.9.1's GSPO aggregates by loss_agg_mode (the paper's is seq-mean-token-mean)."""
    # sequence ratios: s_0 = (2·0.5·1)^(1/3) = 1, s_1 = (4·1)^(1/2) = 2 (the padding ratio 9 is ignored)
    old, new = _log_probs([[2.0, 0.5, 1.0], [4.0, 1.0, 9.0]])
    adv = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    # per token: seq 0: −A·1 = −1, −2, −3 (unclipped); seq 1: max(−2, −1.2) = −1.2 twice (clipped)
    loss, metrics = pl.compute_policy_loss_gspo(old, new, adv, MASK, loss_agg_mode="seq-mean-token-mean")
    _approx(loss, (-2.0 - 1.2) / 2)  # sequence means −2 and −1.2
    _approx(metrics["actor/pg_clipfrac"], 2 / 5)
    _approx(metrics["actor/ppo_kl"], -math.log(2.0 * 0.5 * 4.0) / 5)
    # the gradient reaches each token through π/sg(π): −A_t·s_0 / 3 tokens / 2 sequences; seq 1 is clipped
    _close(_grad(loss, new), [[-1 / 6, -2 / 6, -3 / 6], [0.0, 0.0, 0.0]])
    old, new = _log_probs([[2.0, 0.5, 1.0], [4.0, 1.0, 9.0]])
    loss = pl.compute_policy_loss_gspo(old, new, adv, MASK, loss_agg_mode="token-mean")[0]
    _approx(loss, (-1.0 - 2.0 - 3.0 - 1.2 - 1.2) / 5)  # the 5 tokens' mean
    _close(_grad(loss, new), [[-1 / 5, -2 / 5, -3 / 5], [0.0, 0.0, 0.0]])
    old, new = _log_probs([[2.0, 0.5, 1.0], [4.0, 1.0, 9.0]])
    loss = pl.compute_policy_loss_gspo(old, new, adv, MASK, loss_agg_mode="seq-mean-token-sum")[0]
    _approx(loss, (-6.0 - 2.4) / 2)  # sequence sums −6 and −2.4


def test_gspo_takes_tiny_clip_bounds_from_policy_loss_kwargs():
    old, new = _log_probs([[2.0, 0.5, 1.0], [1.001, 1.0, 1.0]])
    adv = torch.ones(2, 3, dtype=torch.float64)
    config = ActorConfig(policy_loss_kwargs={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4})
    loss, metrics = pl.compute_policy_loss_gspo(old, new, adv, MASK, config=config)
    # s_0 = 1 (inside), s_1 = 1.001^(1/2) ≈ 1.0005 > 1.0004: clipped to 1.0004; token-mean (the default)
    _approx(loss, (3 * -1.0 + 2 * -1.0004) / 5)
    _approx(metrics["actor/pg_clipfrac"], 2 / 5)


# ---------------------------------------------------------------- gpg


def test_gpg_hand_case():
    old, new = _log_probs(VANILLA_RATIO, log_prob=[[-1.0, -2.0, -0.5], [-3.0, -1.0, -7.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, -1.0, 5.0]], dtype=torch.float64)
    loss, metrics = pl.compute_policy_loss_gpg(old, new, adv, MASK)
    # −A·log π: 1, 2, −0.5, 6, −1 → 7.5 / 5 (no ratio: VANILLA_RATIO only moves ppo_kl)
    _approx(loss, 1.5)
    _approx(metrics["actor/pg_clipfrac"], 0.0)
    _close(_grad(loss, new), [[-0.2, -0.2, 0.2], [-0.4, 0.2, 0.0]])  # −A / 5


# ---------------------------------------------------------------- clip_cov and kl_cov

# log π and A chosen so the centred covariance is easy: over the 5 masked tokens mean A = 0.2 and
# mean log π = −1.8, so cov = (A − 0.2)(log π + 1.8):
#   (0,0) 0.8·0.8 = 0.64   (0,1) 0.8·(−0.2) = −0.16   (0,2) (−1.2)·0.8 = −0.96
#   (1,0) (−1.2)·(−0.2) = 0.24   (1,1) 0.8·(−1.2) = −0.96   padding (1,2) would be 4.8·6.8 = 32.64
COV_LOG_PROB = [[-1.0, -2.0, -1.0], [-2.0, -3.0, 5.0]]
COV_ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 1.0, 5.0]], dtype=torch.float64)


def test_clip_cov_detaches_the_high_covariance_token():
    old, new = _log_probs([[1.1, 1.5, 1.0], [1.0, 0.5, 1.0]], log_prob=COV_LOG_PROB)
    config = {
        "policy_loss_kwargs": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.5, "clip_cov_ub": 1.0, "seed": 0}
    }
    loss, metrics = pl.compute_policy_loss_clip_cov(old, new, COV_ADV, MASK, config=config)
    # PPO clip, ε = 0.2: −1.1, max(−1.5, −1.2) = −1.2 (clipped), 1, 1, max(−0.5, −0.8) = −0.5 → −0.8 / 5
    _approx(loss, -0.16)
    _approx(metrics["actor/pg_clipfrac"], 1 / 5)
    # only (0,0) has cov in [0.5, 1]; ⌊0.2·5⌋ = 1 token is detached: its gradient −1.1/5 becomes 0
    _approx(metrics["actor/clip_cov_frac"], 1 / 5)
    _close(_grad(loss, new), [[0.0, 0.0, 0.2], [0.2, -0.1, 0.0]])  # −A·r / 5 where not clipped
    # default bounds [1, 5]: no candidate, nothing detached
    loss, metrics = pl.compute_policy_loss_clip_cov(old, new, COV_ADV, MASK, config={"seed": 0})
    _approx(metrics["actor/clip_cov_frac"], 0.0)
    _close(_grad(loss, new), [[-0.22, 0.0, 0.2], [0.2, -0.1, 0.0]])


def test_clip_cov_random_choice_is_reproducible_with_a_seed():
    gen = torch.Generator().manual_seed(0)
    old, new = _log_probs(torch.rand(4, 10, generator=gen).add(0.9).tolist())
    adv = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 10, dtype=torch.long)

    def detached_tokens(seed):
        kwargs = {"clip_cov_ratio": 0.25, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9, "seed": seed}
        loss, metrics = pl.compute_policy_loss_clip_cov(
            old, new, adv, mask, config={"policy_loss_kwargs": kwargs, "clip_ratio": 10.0}
        )
        _approx(metrics["actor/clip_cov_frac"], 10 / 40)  # ⌊0.25·40⌋ of 40 tokens
        return _grad(loss, new) == 0  # nothing clips with ε = 10, so zero gradient = detached

    first = detached_tokens(1)
    assert int(first.sum()) == 10
    assert torch.equal(first, detached_tokens(1))
    assert not torch.equal(first, detached_tokens(2))


def test_kl_cov_penalises_the_top_covariance_tokens():
    old, new = _log_probs([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]], log_prob=COV_LOG_PROB)
    config = {"policy_loss_kwargs": {"kl_cov_ratio": 0.2}}
    loss, metrics = pl.compute_policy_loss_kl_cov(old, new, COV_ADV, MASK, config=config)
    # −A·r: −2, −1, 1, 1, −0.5 → −1.5; top ⌊0.2·5⌋ = 1 token by cov is (0,0) (the padding's 32.64 is
    # masked): + 1.0·|log 2|
    _approx(loss, (-1.5 + math.log(2.0)) / 5)
    _approx(metrics["actor/kl_cov_frac"], 1 / 5)
    _approx(metrics["actor/pg_clipfrac"], 0.0)
    # d/d log π: (0,0) −A·r + β·sign(log r) = −2 + 1; elsewhere −A·r; over 5 tokens
    _close(_grad(loss, new), [[-0.2, -0.2, 0.2], [0.2, -0.1, 0.0]])
    loss, _ = pl.compute_policy_loss_kl_cov(
        old, new, COV_ADV, MASK, config={"policy_loss_kwargs": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 2.0}}
    )
    _approx(loss, (-1.5 + 2 * math.log(2.0)) / 5)


def test_token_fraction_out_of_range_is_an_error():
    old, new = _log_probs(VANILLA_RATIO)
    with pytest.raises(ValueError, match=r"kl_cov_ratio=1.5 must lie in \[0, 1\]"):
        pl.compute_policy_loss_kl_cov(old, new, VANILLA_ADV, MASK, config={"kl_cov_ratio": 1.5})


# ---------------------------------------------------------------- geo_mean

GEO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # sequence 2 is fully masked
GEO_ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 9.0], [100.0, 100.0, 100.0]], dtype=torch.float64)
GEO_RATIO = [[math.exp(0.3), math.exp(-0.3), 1.0], [math.exp(0.3), math.exp(-0.5), 5.0], [3.0, 3.0, 3.0]]


def test_geo_mean_hand_case():
    old, new = _log_probs(GEO_RATIO)
    loss, metrics = pl.compute_policy_loss_geo_mean(old, new, GEO_ADV, GEO_MASK, loss_agg_mode="token-mean")
    # ε = 0.2 in log space. seq 0, A = 1 > 0, clip above: log r (0.3, −0.3, 0) → (0.2, −0.3, 0),
    #   mean −0.1/3, L_0 = −1·exp(−1/30). seq 1, A = −2 < 0, clip below: (0.3, −0.5) → (0.3, −0.2),
    #   mean 0.05, L_1 = 2·exp(0.05). Seq 2 is empty. Loss (L_0 + L_1) / 2.
    _approx(loss, (-math.exp(-1 / 30) + 2 * math.exp(0.05)) / 2)
    _approx(metrics["actor/pg_clipfrac"], 2 / 5)  # (0,0) above 0.2 and (1,1) below −0.2
    # d/d log π of an unclipped token: −A_i·exp(mean ℓ) / |o_i| / 2 sequences; clipped tokens: 0
    g0, g1 = -math.exp(-1 / 30) / 3 / 2, 2 * math.exp(0.05) / 2 / 2
    _close(_grad(loss, new), [[0.0, g0, g0], [g1, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_geo_mean_weights_enter_as_their_geometric_mean():
    old, new = _log_probs(GEO_RATIO)
    weights = torch.tensor([[1.0, 2.0, 4.0], [3.0, 3.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _ = pl.compute_policy_loss_geo_mean(old, new, GEO_ADV, GEO_MASK, rollout_is_weights=weights)
    # geometric means: (1·2·4)^(1/3) = 2 and (3·3)^(1/2) = 3 (zeros only on masked tokens)
    _approx(loss, (-2 * math.exp(-1 / 30) + 3 * 2 * math.exp(0.05)) / 2)


# ---------------------------------------------------------------- cispo


def test_cispo_hand_case_keeps_a_gradient_on_clipped_tokens():
    old, new = _log_probs([[1.1, 1.5, 0.5], [1.0, 0.7, 3.0]], log_prob=[[-1.0] * 3, [-2.0] * 3])
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, -1.0, 5.0]], dtype=torch.float64)
    loss, metrics = pl.compute_policy_loss_cispo(old, new, adv, MASK)
    # −sg(clip(r, 0.8, 1.2))·A·log π: −1.1·1·(−1) = 1.1, −1.2·1·(−1) = 1.2, −0.8·(−1)·(−1) = −0.8,
    #   −1·2·(−2) = 4, −0.8·(−1)·(−2) = −1.6 → 3.9 / 5
    _approx(loss, 0.78)
    _approx(metrics["actor/pg_clipfrac"], 3 / 5)
    # d/d log π = −sg(clip r)·A / 5, nonzero on the clipped tokens too
    _close(_grad(loss, new), [[-0.22, -0.24, 0.16], [-0.4, 0.16, 0.0]])


# ---------------------------------------------------------------- sapo


def test_sapo_hand_case():
    ln3 = math.log(3.0)
    # σ(τ(r − 1)) = σ(0) = 1/2 at r = 1 and σ(ln 3) = 3/4 at τ(r − 1) = ln 3
    old, new = _log_probs([[1.0, 1.0 + ln3], [1.0, 1.0 + ln3 / 1.05]])
    adv = torch.tensor([[1.0, 2.0], [-1.0, -2.0]], dtype=torch.float64)
    loss, metrics = pl.compute_policy_loss_sapo(old, new, adv, torch.ones(2, 2))
    # f = σ·4/τ: τ_pos = 1: 2 and 3; τ_neg = 1.05: 2/1.05 and 3/1.05
    # −f·A: −2, −6, 2/1.05, 6/1.05 → (−8 + 8/1.05) / 4 = −2/21
    _approx(loss, -2 / 21)
    _approx(metrics["actor/pg_clipfrac"], 0.0)
    # at r = 1, df/d log r = 4σ(1 − σ)·r = 1: the gradient is PPO's, −A / 4 tokens
    grad = _grad(loss, new)
    _approx(grad[0, 0], -0.25)
    _approx(grad[1, 0], 0.25)
    # (0,1): 4·(3/4)(1/4)·r = 0.75·(1 + ln 3), times −A/4 = −1/2
    _approx(grad[0, 1], -0.75 * (1 + ln3) / 2)


def test_sapo_always_aggregates_seq_mean_token_mean():
    """verl 0.9.1's SAPO ignores loss_agg_mode: every sequence weighs the same, whatever its length."""
    old, new = _log_probs([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 2.0, 3.0], [-3.0, -3.0, 5.0]], dtype=torch.float64)
    # at r = 1, f = 2/τ: −2·A for A > 0 (τ_pos 1); −(2/1.05)·A for A < 0; the padding token is ignored
    seq0, seq1 = (-2.0 - 4.0 - 6.0) / 3, (6.0 / 1.05 + 6.0 / 1.05) / 2
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = pl.compute_policy_loss_sapo(old, new, adv, MASK, loss_agg_mode=mode)
        _approx(loss, (seq0 + seq1) / 2)


def test_sapo_reads_tau_from_policy_loss_kwargs():
    old, new = _log_probs([[1.0, 1.0], [1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    config = ActorConfig(policy_loss_kwargs={"tau_pos": 2.0, "tau_neg": 4.0})
    loss, _ = pl.compute_policy_loss_sapo(old, new, adv, torch.ones(2, 2), config=config)
    _approx(loss, (-1.0 - 1.0 + 0.5 + 0.5) / 4)  # f(1) = 2/τ: 1 for A > 0, 0.5 for A < 0
    with pytest.raises(ValueError, match=r"sapo: tau_neg=0.0 must be > 0"):
        pl.compute_policy_loss_sapo(old, new, adv, torch.ones(2, 2), config={"tau_neg": 0.0})


# ---------------------------------------------------------------- every loss


@pytest.mark.parametrize("name", NAMES)
def test_registry_round_trip(name):
    assert trellis.registries.get_policy_loss_fn(name) is getattr(pl, f"compute_policy_loss_{name}")


def _random_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    old = log_prob + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [0], [5]])).long()
    return old, log_prob, adv, mask


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_ignores_padding_and_scales_with_constant_weights(name):
    fn = trellis.registries.get_policy_loss_fn(name)
    config = {
        "policy_loss_kwargs": {"seed": 0, "clip_cov_ratio": 0.2, "clip_cov_lb": -1e9, "kl_cov_ratio": 0.2}
    }
    old, log_prob, adv, mask = _random_inputs()
    log_prob.requires_grad_(True)
    loss, metrics = fn(old, log_prob, adv, mask, config=config)
    assert loss.shape == () and torch.isfinite(loss)
    assert {"actor/pg_clipfrac", "actor/ppo_kl"} <= set(metrics)
    assert all(not torch.as_tensor(value).requires_grad for value in metrics.values())
    grad = _grad(loss, log_prob)
    assert torch.all(grad[mask == 0] == 0) and grad.abs().sum() > 0

    # garbage on the padding changes nothing
    padding = mask == 0
    noisy = [torch.where(padding, torch.full_like(t, 7.0), t) for t in (old, log_prob.detach(), adv)]
    again, _ = fn(*noisy, mask, config=config)
    _approx(again, loss.item())

    # constant weights 2 double the loss
    doubled, _ = fn(old, log_prob, adv, mask, config=config, rollout_is_weights=torch.full_like(adv, 2.0))
    _approx(doubled, 2 * loss.item())


# ---------------------------------------------------------------- value and entropy losses


def test_value_loss_hand_case():
    values = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    vpreds = torch.tensor([[0.2, 1.0], [2.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = pl.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # v_clip = V + clip(v − V, ±0.5) = 0.2, 0.5, 1.5
    # max((v − R)², (v_clip − R)²): max(0.64, 0.64) = 0.64, max(0, 0.25) = 0.25 (clipped), max(4, 2.25) = 4
    # 0.5·(0.64 + 0.25 + 4) / 3
    _approx(loss, 0.815)
    _approx(metrics["critic/vf_clipfrac"], 1 / 3)
    # d/dv = (v − R) / 3 where unclipped: −0.8/3, 0 (clipped), 2/3
    _close(_grad(loss, vpreds), [[-0.8 / 3, 0.0], [2 / 3, 0.0]])
    seq_loss, _ = pl.compute_value_loss(vpreds, returns, values, mask, 0.5, "seq-mean-token-sum")
    _approx(seq_loss, 0.5 * (0.64 + 0.25 + 4) / 2)
    with pytest.raises(ValueError, match="cliprange_value=0 must be > 0"):
        pl.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0)


def test_entropy_loss_hand_case():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _approx(pl.compute_entropy_loss(entropy, mask), 7 / 3)  # (1 + 2 + 4) / 3
    _approx(pl.compute_entropy_loss(entropy, mask, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    info = {"dp_size": 2, "batch_num_tokens": 7}
    _approx(pl.compute_entropy_loss(entropy, mask, global_batch_info=info), 2.0)  # 7 / 7 × 2


def test_a_config_without_get_is_a_type_error():
    old, new = _log_probs(VANILLA_RATIO)
    with pytest.raises(TypeError, match=r"config must be None, a dict or an object with \.get"):
        pl.compute_policy_loss_vanilla(old, new, VANILLA_ADV, MASK, config=[("clip_ratio", 0.1)])

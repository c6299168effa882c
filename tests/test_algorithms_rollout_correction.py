"""trellis.algorithms.rollout_correction: importance weights, rejection and mismatch metrics,
checked against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.algorithms.rollout_correction import (
    compute_rollout_correction_and_rejection_mask,
    rollout_correction_from_config,
)
from trellis.config import ConfigValueError, RolloutCorrectionConfig, load_config, to_yaml

NAN, INF = float("nan"), float("inf")
e = math.exp

# Three responses over 4 positions; log ρ = old − rollout on the response tokens:
#   row 0: [0.2, -0.5, 0.0]   (one padding position)
#   row 1: [0.0, -0.6]        (two)
#   row 2: [0.1, 0.1, 0.1, 0.1]
# so k1 = -log ρ is [-0.2, 0.5, 0] / [0, 0.6] / [-0.1]*4. Padding holds garbage on purpose.
OLD = torch.tensor(
    [[-1.0, -2.0, -0.5, NAN], [-0.3, -0.7, INF, -INF], [-0.4, -0.4, -0.4, -0.4]], dtype=torch.float64
)
ROLLOUT = torch.tensor(
    [[-1.2, -1.5, -0.5, 7.0], [-0.3, -0.1, INF, NAN], [-0.5, -0.5, -0.5, -0.5]], dtype=torch.float64
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
RATIO = [[e(0.2), e(-0.5), 1.0, 0.0], [1.0, e(-0.6), 0.0, 0.0], [e(0.1)] * 4]  # ρ_t, 0 on padding
SEQ_RATIO = [e(-0.3), e(-0.6), e(0.4)]  # Π_t ρ_t per response
TOKENS, RESPONSES = 9, 3


def k3(x: float) -> float:
    return e(x) - 1 - x


def run(**options):
    return compute_rollout_correction_and_rejection_mask(OLD, ROLLOUT, MASK, **options)


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )


def on_responses(values):
    """Per-response weights spread over each response's tokens (0 on padding)."""
    return [[values[i] * m for m in row] for i, row in enumerate(MASK.tolist())]


# ---------------------------------------------------------------- importance weights


def test_no_weights_and_no_rejection_by_default():
    weights, new_mask, metrics = run()
    assert weights is None
    assert torch.equal(new_mask, MASK) and new_mask.dtype == MASK.dtype
    assert metrics["rollout_corr/rejected_token_frac"] == 0.0
    assert not any(name.startswith("rollout_corr/is_") for name in metrics)


def test_token_weights_are_the_ratios():
    weights, _, metrics = run(rollout_is="token", rollout_is_threshold=None)
    close(weights, RATIO)
    assert weights.dtype == torch.float64 and not weights.requires_grad
    kept = [e(0.2), e(-0.5), 1.0, 1.0, e(-0.6)] + [e(0.1)] * 4
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(sum(kept) / 9, abs=1e-6)
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(e(0.2), abs=1e-6)
    assert metrics["rollout_corr/is_weight_min"] == pytest.approx(e(-0.6), abs=1e-6)
    assert "rollout_corr/is_truncated_frac" not in metrics and "rollout_corr/is_zeroed_frac" not in metrics


def test_sequence_weights_are_the_product_of_ratios_on_every_token():
    weights, _, metrics = run(rollout_is="sequence", rollout_is_threshold=None)
    close(weights, on_responses(SEQ_RATIO))
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(
        sum(SEQ_RATIO) / 3, abs=1e-6
    )  # per response
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(e(0.4), abs=1e-6)


def test_truncation_caps_token_weights():
    weights, _, metrics = run(rollout_is="token", rollout_is_threshold=1.1)  # the default form: a number
    close(weights, [[1.1, e(-0.5), 1.0, 0.0], [1.0, e(-0.6), 0.0, 0.0], [1.1] * 4])
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(5 / 9, abs=1e-6)  # e^0.2 and 4 × e^0.1
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(1.1, abs=1e-6)


def test_truncation_caps_sequence_weights():
    weights, _, metrics = run(rollout_is="sequence", rollout_is_threshold="1.2")  # a string of one number
    close(weights, on_responses([e(-0.3), e(-0.6), 1.2]))
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 3, abs=1e-6)


@pytest.mark.parametrize("band", ["0.6_1.15", (0.6, 1.15), [0.6, 1.15]])
def test_band_zeroes_token_weights_outside_it(band):
    weights, _, metrics = run(rollout_is="token", rollout_is_threshold=band)
    close(weights, [[0.0, e(-0.5), 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [e(0.1)] * 4])
    assert metrics["rollout_corr/is_zeroed_frac"] == pytest.approx(2 / 9, abs=1e-6)  # e^0.2 and e^-0.6
    assert metrics["rollout_corr/is_weight_min"] == 0.0
    assert "rollout_corr/is_truncated_frac" not in metrics


def test_band_zeroes_sequence_weights_outside_it():
    weights, _, metrics = run(rollout_is="sequence", rollout_is_threshold="0.6_1.2")
    close(weights, on_responses([e(-0.3), 0.0, 0.0]))
    assert metrics["rollout_corr/is_zeroed_frac"] == pytest.approx(2 / 3, abs=1e-6)


def test_batch_normalisation_makes_the_token_mean_one():
    weights, _, metrics = run(rollout_is="token", rollout_is_threshold=None, rollout_is_batch_normalize=True)
    mean = (e(0.2) + e(-0.5) + 1 + 1 + e(-0.6) + 4 * e(0.1)) / 9
    close(weights, [[w / mean for w in row] for row in RATIO])
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_batch_normalisation_of_sequence_weights_averages_over_responses_after_truncation():
    weights, _, metrics = run(
        rollout_is="sequence", rollout_is_threshold=1.2, rollout_is_batch_normalize=True
    )
    truncated = [e(-0.3), e(-0.6), 1.2]
    mean = sum(truncated) / 3  # over responses, not tokens
    close(weights, on_responses([w / mean for w in truncated]))
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 3, abs=1e-6)


def test_batch_normalisation_leaves_all_zero_weights_alone():
    weights, _, _ = run(rollout_is="token", rollout_is_threshold="5_6", rollout_is_batch_normalize=True)
    assert torch.equal(weights, torch.zeros_like(weights))


def test_huge_log_ratios_are_clamped_before_exp():
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float32)
    rollout = torch.tensor([[-500.0, -500.0]], dtype=torch.float32)
    mask = torch.ones(1, 2)
    weights, _, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=None
    )
    torch.testing.assert_close(weights, torch.full((1, 2), e(20.0)))  # Σ log ρ = 1000, clamped to 20
    assert all(math.isfinite(value) for value in metrics.values())


def test_low_precision_inputs_are_computed_in_float32():
    weights, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        OLD.to(torch.bfloat16), OLD.to(torch.bfloat16), MASK.bool(), rollout_is="token"
    )
    assert weights.dtype == torch.float32 and new_mask.dtype == torch.bool
    assert torch.equal(weights, MASK.float())


# ---------------------------------------------------------------- rejection

# Per response (rows 0, 1, 2) the statistics are:
#   k1: |Σ| 0.3, 0.6, 0.4   |mean| 0.1, 0.3, 0.1   max|.| 0.5, 0.6, 0.1
#   k2 per token [0.02, 0.125, 0] / [0, 0.18] / [0.005]*4: Σ 0.145, 0.18, 0.02; mean 0.0483, 0.09, 0.005
#   k3 per token [k3(.2)=0.0214, k3(-.5)=0.1065, 0] / [0, k3(-.6)=0.1488] / [k3(.1)=0.00517]*4:
#      Σ 0.1279, 0.1488, 0.0207; mean 0.0426, 0.0744, 0.00517; max 0.1065, 0.1488, 0.00517
ALL_KEPT = MASK.tolist()


def drop_tokens(*positions):
    rows = [list(row) for row in ALL_KEPT]
    for i, t in positions:
        rows[i][t] = 0
    return rows


def drop_responses(*indices):
    return [[0] * 4 if i in indices else list(row) for i, row in enumerate(ALL_KEPT)]


@pytest.mark.parametrize(
    ("criterion", "threshold", "expected", "share"),
    [
        ("token_k1", 0.3, drop_tokens((0, 1), (1, 1)), 2 / 9),  # |k1| 0.5 and 0.6
        ("token_k2", 0.15, drop_tokens((1, 1)), 1 / 9),  # k2 0.18
        ("token_k3", 0.01, drop_tokens((0, 0), (0, 1), (1, 1)), 3 / 9),  # k3 0.0214, 0.1065, 0.1488
        ("seq_sum_k1", 0.35, drop_responses(1, 2), 2 / 3),  # signed sum: row 0 is |-0.2+0.5| = 0.3
        ("seq_mean_k1", 0.2, drop_responses(1), 1 / 3),  # signed mean: row 0 is 0.1
        ("seq_max_k1", 0.45, drop_responses(0, 1), 2 / 3),
        ("seq_sum_k2", 0.15, drop_responses(1), 1 / 3),
        ("seq_mean_k2", 0.04, drop_responses(0, 1), 2 / 3),
        ("seq_max_k2", 0.15, drop_responses(1), 1 / 3),
        ("seq_sum_k3", 0.1, drop_responses(0, 1), 2 / 3),
        ("seq_mean_k3", 0.05, drop_responses(1), 1 / 3),
        ("seq_max_k3", 0.01, drop_responses(0, 1), 2 / 3),
    ],
)
def test_each_criterion_rejects_what_exceeds_its_threshold(criterion, threshold, expected, share):
    _, new_mask, metrics = run(rollout_rs=criterion, rollout_rs_threshold=threshold)
    assert new_mask.tolist() == expected and new_mask.dtype == MASK.dtype
    assert metrics[f"rollout_corr/rs_{criterion}_frac"] == pytest.approx(share, abs=1e-6)
    rejected_tokens = TOKENS - sum(map(sum, expected))
    assert metrics["rollout_corr/rejected_token_frac"] == pytest.approx(rejected_tokens / TOKENS, abs=1e-6)
    emptied = sum(1 for row in expected if not any(row))
    assert metrics["rollout_corr/rejected_seq_frac"] == pytest.approx(emptied / RESPONSES, abs=1e-6)


def test_a_threshold_equal_to_the_statistic_keeps():
    _, new_mask, _ = run(rollout_rs="seq_max_k1", rollout_rs_threshold=0.6 + 1e-12)
    assert new_mask.tolist() == ALL_KEPT


@pytest.mark.parametrize("thresholds", ["0.2,0.1", [0.2, 0.1], (0.2, 0.1), " 0.2 , 0.1 "])
def test_combined_criteria_reject_what_any_of_them_rejects(thresholds):
    weights, new_mask, metrics = run(
        rollout_rs="seq_mean_k1, token_k2", rollout_rs_threshold=thresholds, rollout_is="token"
    )
    # seq_mean_k1 > 0.2 drops response 1; token_k2 > 0.1 drops tokens (0, 1) and (1, 1)
    assert new_mask.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert metrics["rollout_corr/rs_seq_mean_k1_frac"] == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["rollout_corr/rs_token_k2_frac"] == pytest.approx(2 / 9, abs=1e-6)
    assert metrics["rollout_corr/rejected_token_frac"] == pytest.approx(3 / 9, abs=1e-6)
    assert metrics["rollout_corr/rejected_seq_frac"] == pytest.approx(1 / 3, abs=1e-6)
    # weights are 0 where rejected, and their statistics cover the kept tokens only
    close(weights, [[e(0.2), 0.0, 1.0, 0.0], [0.0] * 4, [e(0.1)] * 4])
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx((e(0.2) + 1 + 4 * e(0.1)) / 6, abs=1e-6)


def test_one_threshold_applies_to_every_criterion():
    _, new_mask, metrics = run(rollout_rs="seq_max_k1,token_k1", rollout_rs_threshold=0.45)
    assert new_mask.tolist() == drop_responses(0, 1)
    assert metrics["rollout_corr/rs_token_k1_frac"] == pytest.approx(2 / 9, abs=1e-6)


def test_rejecting_everything_leaves_zero_weights_and_empty_statistics():
    weights, new_mask, metrics = run(rollout_rs="token_k3", rollout_rs_threshold=1e-9, rollout_is="sequence")
    assert new_mask.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # ρ = 1 exactly: k3 = 0
    close(weights, [[0, 0, 1, 0], [1, 0, 0, 0], [0] * 4])
    weights, new_mask, metrics = run(rollout_rs="seq_max_k2", rollout_rs_threshold=1e-9, rollout_is="token")
    assert not new_mask.any() and not weights.any()
    assert metrics["rollout_corr/rejected_seq_frac"] == 1.0
    assert (metrics["rollout_corr/is_weight_max"], metrics["rollout_corr/is_weight_mean"]) == (0.0, 0.0)


# ---------------------------------------------------------------- metrics


def test_metrics_on_the_hand_case():
    _, _, metrics = run(rollout_is="token")
    kept = [0.2, -0.5, 0.0, 0.0, -0.6, 0.1, 0.1, 0.1, 0.1]  # log ρ on the 9 tokens
    expected = {
        "kl_k1": 0.5 / 9,  # mean of -log ρ
        "kl_k2": 0.345 / 9,  # mean of ½ (log ρ)²
        "kl_k3": sum(k3(x) for x in kept) / 9,
        "ppl_train": e(6.1 / 9),  # mean NLL under the trainer: (1+2+0.5+0.3+0.7+4×0.4)/9
        "ppl_rollout": e(5.6 / 9),  # (1.2+1.5+0.5+0.3+0.1+4×0.5)/9
        "ppl_ratio": e(0.5 / 9),
        "chi2_token": sum(e(2 * x) for x in kept) / 9 - 1,  # mean ρ² − 1
        "chi2_seq": sum(r * r for r in SEQ_RATIO) / 3 - 1,  # mean (Π ρ)² − 1
        "rejected_token_frac": 0.0,
        "rejected_seq_frac": 0.0,
        "is_truncated_frac": 0.0,  # nothing above 2.0
    }
    for name, value in expected.items():
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(value, abs=1e-6), name
    assert all(name.startswith("rollout_corr/") and type(value) is float for name, value in metrics.items())


def test_identical_policies_give_unit_weights_no_rejection_and_zero_divergence():
    torch.manual_seed(0)
    log_prob = -torch.rand(5, 7) * 3
    mask = (torch.rand(5, 7) > 0.3).long()
    mask[:, 0] = 1
    for level in ("token", "sequence"):
        weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob,
            log_prob.clone(),
            mask,
            rollout_is=level,
            rollout_is_batch_normalize=True,
            rollout_rs="token_k1,token_k2,token_k3,seq_sum_k1,seq_mean_k3,seq_max_k2",
            rollout_rs_threshold=1e-6,
        )
        assert torch.equal(weights, mask.float()) and torch.equal(new_mask, mask)
        for name in ("kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "rejected_token_frac"):
            assert metrics[f"rollout_corr/{name}"] == 0.0, name
        assert metrics["rollout_corr/ppl_ratio"] == 1.0
        assert metrics["rollout_corr/ppl_train"] == pytest.approx(metrics["rollout_corr/ppl_rollout"])
        assert metrics["rollout_corr/is_weight_min"] == metrics["rollout_corr/is_weight_max"] == 1.0


@pytest.mark.parametrize(
    "options",
    [
        {"rollout_is": "token", "rollout_is_threshold": 1.1},
        {"rollout_is": "sequence", "rollout_is_threshold": "0.6_1.2", "rollout_is_batch_normalize": True},
        {"rollout_rs": "token_k3,seq_sum_k1,seq_max_k2", "rollout_rs_threshold": [0.01, 0.35, 0.15]},
        {"rollout_is": "sequence", "rollout_rs": "seq_mean_k2", "rollout_rs_threshold": 0.04},
    ],
)
def test_padding_values_change_nothing(options):
    clean_old = torch.where(MASK.bool(), OLD, torch.zeros_like(OLD))
    clean_rollout = torch.where(MASK.bool(), ROLLOUT, torch.zeros_like(ROLLOUT))
    garbage = compute_rollout_correction_and_rejection_mask(OLD, ROLLOUT, MASK, **options)
    clean = compute_rollout_correction_and_rejection_mask(clean_old, clean_rollout, MASK, **options)
    if garbage[0] is not None:
        assert torch.equal(garbage[0], clean[0])
        assert torch.equal(garbage[0] * (1 - MASK), torch.zeros_like(garbage[0]))  # 0 on padding
    assert torch.equal(garbage[1], clean[1])
    assert garbage[2] == clean[2] and all(math.isfinite(value) for value in garbage[2].values())


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_the_new_mask_keeps_the_mask_dtype(dtype):
    _, new_mask, _ = run_with_mask(MASK.to(dtype), rollout_rs="token_k1", rollout_rs_threshold=0.3)
    assert new_mask.dtype == dtype and new_mask.long().tolist() == drop_tokens((0, 1), (1, 1))


def run_with_mask(mask, **options):
    return compute_rollout_correction_and_rejection_mask(OLD, ROLLOUT, mask, **options)


def test_weights_are_detached():
    old = OLD.clone().requires_grad_(True)
    weights, _, _ = compute_rollout_correction_and_rejection_mask(old, ROLLOUT, MASK, rollout_is="token")
    assert not weights.requires_grad and weights.grad_fn is None


# ---------------------------------------------------------------- errors

VALID_CRITERIA = (
    "token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, "
    "seq_mean_k3, seq_max_k1, seq_max_k2, seq_max_k3"
)


def error_of(old=OLD, rollout=ROLLOUT, mask=MASK, **options) -> str:
    with pytest.raises(ValueError) as info:
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, **options)
    return str(info.value)


def test_shape_errors_name_both_shapes():
    assert error_of(rollout=ROLLOUT[:, :3]) == (
        "rollout_log_prob has shape (3, 3) but old_log_prob has shape (3, 4); both must be (bs, T) over the "
        "same response tokens."
    )
    assert error_of(mask=MASK[:2]) == (
        "response_mask has shape (2, 4) but old_log_prob has shape (3, 4); both must be (bs, T) over the "
        "same response tokens."
    )
    assert error_of(old=OLD[0], rollout=ROLLOUT[0], mask=MASK[0]) == (
        "old_log_prob must have shape (bs, T) (2 dimensions); got shape (4,). Pass response tokens only, one "
        "row per response."
    )
    assert (
        error_of(mask=MASK.tolist()) == "response_mask must be a torch.Tensor of shape (bs, T); got a list."
    )


def test_an_empty_mask_is_an_error():
    assert error_of(mask=torch.zeros_like(MASK)) == (
        "response_mask of shape (3, 4) selects no token; there is nothing to correct. Leave empty batches "
        "out before calling compute_rollout_correction_and_rejection_mask."
    )


def test_unknown_options_list_the_valid_ones():
    assert error_of(rollout_is="tokens") == (
        "rollout_is must be one of None, 'token', 'sequence'; got 'tokens'. 'token' weighs each token by its "
        "own ratio, 'sequence' each response by the product of its tokens' ratios."
    )
    assert error_of(rollout_rs="token_k1,seq_avg_k2", rollout_rs_threshold=1) == (
        f"rollout_rs must be criteria joined by commas, each one of {VALID_CRITERIA}; got "
        "'token_k1,seq_avg_k2'. Unknown criterion 'seq_avg_k2'."
    )
    assert error_of(rollout_rs="token_k1,", rollout_rs_threshold=1) == (
        f"rollout_rs must be criteria joined by commas, each one of {VALID_CRITERIA}; got 'token_k1,'. "
        "An empty name."
    )
    assert error_of(rollout_rs=["token_k1"], rollout_rs_threshold=1) == (
        f"rollout_rs must be criteria joined by commas, each one of {VALID_CRITERIA}, or null; got "
        "['token_k1']."
    )
    assert error_of(rollout_rs="token_k1,token_k1", rollout_rs_threshold=1) == (
        "rollout_rs must name each criterion once; got 'token_k1,token_k1'. Repeated: 'token_k1'."
    )


def test_rejection_threshold_errors():
    assert error_of(rollout_rs="token_k1") == (
        "rollout_rs_threshold must be set when rollout_rs 'token_k1' is set: a number, a comma-separated "
        "string of numbers or a list of numbers, one per criterion or one for all; got None."
    )
    assert error_of(rollout_rs="token_k1,seq_sum_k2", rollout_rs_threshold=[1, 2, 3]) == (
        "rollout_rs_threshold must give 1 number (for all criteria) or 2 (one per criterion of rollout_rs "
        "'token_k1,seq_sum_k2'); got [1, 2, 3]. It gives 3."
    )
    assert error_of(rollout_rs="token_k1", rollout_rs_threshold="0.1,0.2") == (
        "rollout_rs_threshold must give 1 number (for all criteria) or 1 (one per criterion of rollout_rs "
        "'token_k1'); got '0.1,0.2'. It gives 2."
    )
    for bad in (0, -1.0, "0.1,-2", NAN):
        assert error_of(rollout_rs="token_k1,token_k2", rollout_rs_threshold=bad) == (
            f"rollout_rs_threshold must hold numbers > 0 (divergences above them are rejected); got {bad!r}."
        )
    for bad in ("abc", "0.1,", True, {"a": 1}):
        assert error_of(rollout_rs="token_k1", rollout_rs_threshold=bad) == (
            "rollout_rs_threshold must be a number, a comma-separated string of numbers or a list of "
            f"numbers; got {bad!r}."
        )


def test_importance_threshold_errors():
    for bad in (0, -2.0, "0_2", (-1, 2)):
        assert error_of(rollout_is="token", rollout_is_threshold=bad) == (
            f"rollout_is_threshold must hold bounds > 0 (weights are ratios of probabilities); got {bad!r}."
        )
    assert error_of(rollout_is="token", rollout_is_threshold="2.0_0.5") == (
        "rollout_is_threshold must name a band with lower < upper; got '2.0_0.5'. Write 'lower_upper', e.g. "
        "'0.5_2.0'."
    )
    forms = (
        "rollout_is_threshold must be a number > 0, a band 'lower_upper' such as '0.5_2.0', a (lower, upper) "
        "pair or null"
    )
    assert (
        error_of(rollout_is_threshold=(1.0, 2.0, 3.0))
        == f"{forms}; got (1.0, 2.0, 3.0). A band has 2 bounds, not 3."
    )
    assert error_of(rollout_is_threshold="a_b") == f"{forms}; got 'a_b'."
    assert error_of(rollout_is_threshold="1_2_3") == f"{forms}; got '1_2_3'."
    assert error_of(rollout_is_batch_normalize=True) == (
        "rollout_is_batch_normalize is True but rollout_is is None: there are no weights to normalise. Set "
        "rollout_is='token' or 'sequence', or rollout_is_batch_normalize=False."
    )


# ---------------------------------------------------------------- from a config


def test_from_config_matches_the_function_for_every_config_form(tmp_path):
    overrides = [
        "rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=0.6_1.2",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=seq_mean_k1,token_k2",
        "algorithm.rollout_correction.rollout_rs_threshold='0.2,0.1'",
    ]
    config = load_config(overrides=overrides)
    correction = config.algorithm.rollout_correction
    assert dict(correction) == {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.6_1.2",
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_mean_k1,token_k2",
        "rollout_rs_threshold": "0.2,0.1",
    }
    assert correction.enabled and not RolloutCorrectionConfig().enabled
    # the YAML round trip gives the same config back
    (tmp_path / "run.yaml").write_text(to_yaml(config))
    assert load_config(tmp_path / "run.yaml") == config

    expected = compute_rollout_correction_and_rejection_mask(OLD, ROLLOUT, MASK, **dict(correction))
    for form in (correction, config.algorithm, dict(correction), {"rollout_correction": dict(correction)}):
        weights, new_mask, metrics = rollout_correction_from_config(OLD, ROLLOUT, MASK, form)
        assert torch.equal(weights, expected[0]) and torch.equal(new_mask, expected[1])
        assert metrics == expected[2]
    weights, new_mask, _ = rollout_correction_from_config(OLD, ROLLOUT, MASK, {})  # all defaults: off
    assert weights is None and torch.equal(new_mask, MASK)


def test_from_config_errors():
    with pytest.raises(ValueError) as info:
        rollout_correction_from_config(OLD, ROLLOUT, MASK, {"mode": "token"})
    assert str(info.value) == (
        "Rollout correction config has unknown keys ['mode']; the keys are rollout_is, rollout_is_threshold, "
        "rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold."
    )
    with pytest.raises(ConfigValueError) as info:
        rollout_correction_from_config(OLD, ROLLOUT, MASK, {"rollout_is": "tok"})
    assert str(info.value) == (
        "Config key 'rollout_is' must be one of 'token', 'sequence' or null; got 'tok'. Closest: 'token'."
    )
    with pytest.raises(ValueError) as info:
        rollout_correction_from_config(OLD, ROLLOUT, MASK, "token")
    assert str(info.value) == (
        "config must be a RolloutCorrectionConfig, an AlgorithmConfig or a mapping of rollout correction "
        "options; got a str."
    )

"""trellis.algorithms.advantage: every estimator on hand-computed cases, its properties and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.algorithms import advantage as adv
from trellis.algorithms.masked import masked_whiten
from trellis.config.schema import AlgorithmConfig
from trellis.registries import get_adv_estimator_fn

NO_EPS = {"epsilon": 0.0}  # hand-computed cases divide by std exactly


def outcome_rewards(scores: list[float], lengths: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with score R_i on the last token of a response of ``lengths[i]`` tokens, and its mask."""
    rewards, mask = torch.zeros(len(scores), T), torch.zeros(len(scores), T, dtype=torch.long)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


def per_sample(advantages: torch.Tensor) -> list[float]:
    """The advantage of each sample, read off its first token."""
    return advantages[:, 0].tolist()


# ---------------------------------------------------------------- registry


ESTIMATORS = {
    "gae": adv.compute_gae_advantage_return,
    "grpo": adv.compute_grpo_outcome_advantage,
    "grpo_passk": adv.compute_grpo_passk_outcome_advantage,
    "rloo": adv.compute_rloo_outcome_advantage,
    "reinforce_plus_plus": adv.compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": adv.compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": adv.compute_remax_outcome_advantage,
    "opo": adv.compute_opo_outcome_advantage,
    "gpg": adv.compute_gpg_outcome_advantage,
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_resolves_by_name(name):
    assert get_adv_estimator_fn(name) is ESTIMATORS[name]


# ---------------------------------------------------------------- gae


def test_gae_hand_computed_with_a_tool_hole():
    # One response of 4 tokens; token 1 is tool output (mask 0) and is skipped. γ = λ = 0.5 (γλ = 0.25).
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    values = torch.tensor([[0.5, 9.0, 0.25, 0.5]])  # V on the tool token is never read
    # t=3: δ = 1 + 0.5·0 − 0.5 = 0.5;               A3 = 0.5
    # t=2: δ = 0 + 0.5·0.5 − 0.25 = 0;             A2 = 0 + 0.25·0.5 = 0.125
    # t=0 (next masked-in token is 2): δ = 0 + 0.5·0.25 − 0.5 = −0.375;  A0 = −0.375 + 0.25·0.125 = −0.34375
    # returns = A + V = [−0.34375 + 0.5, 0, 0.125 + 0.25, 0.5 + 0.5] = [0.15625, 0, 0.375, 1.0]
    # whiten [−0.34375, 0.125, 0.5]: mean 0.28125/3 = 0.09375; deviations −0.4375, 0.03125, 0.40625;
    # squares 0.19140625 + 0.0009765625 + 0.1650390625 = 0.357421875; unbiased var 0.1787109375;
    # A / sqrt(var) with sqrt(var) = 0.4227422:
    #   −0.4375/0.4227422 = −1.0349098, 0.03125/0.4227422 = 0.0739221, 0.40625/0.4227422 = 0.9609876
    advantages, returns = adv.compute_gae_advantage_return(
        rewards, mask, values=values, config=AlgorithmConfig(gamma=0.5, lam=0.5)
    )
    assert returns.tolist() == [[0.15625, 0.0, 0.375, 1.0]]
    torch.testing.assert_close(
        advantages, torch.tensor([[-1.0349098, 0.0, 0.0739221, 0.9609876]]), atol=1e-6, rtol=0
    )


def test_gae_with_unit_gamma_lambda_and_zero_values_is_whitened_reward_to_go():
    torch.manual_seed(0)
    rewards, mask = (
        torch.randn(3, 6),
        torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]]),
    )
    advantages, returns = adv.compute_gae_advantage_return(rewards, mask, values=torch.zeros(3, 6))
    to_go = torch.zeros(3, 6)  # Σ_{t' ≥ t} r_{t'} over the masked-in tokens, with an explicit loop
    for i in range(3):
        for t in range(6):
            if mask[i, t]:
                to_go[i, t] = sum(rewards[i, s].item() for s in range(t, 6) if mask[i, s])
    torch.testing.assert_close(returns, to_go, atol=1e-6, rtol=0)
    torch.testing.assert_close(advantages, masked_whiten(to_go, mask) * mask, atol=1e-6, rtol=0)


def test_gae_skips_a_tool_hole_as_if_it_were_not_there():
    torch.manual_seed(1)
    rewards, values = torch.randn(1, 5), torch.randn(1, 5)
    holed = torch.tensor([[1, 1, 0, 0, 1]])
    # The same response with the two tool tokens cut out, padded at the end.
    keep = [0, 1, 4]
    cut_rewards = torch.zeros(1, 5)
    cut_values = torch.zeros(1, 5)
    cut_rewards[0, :3], cut_values[0, :3] = rewards[0, keep], values[0, keep]
    cut = torch.tensor([[1, 1, 1, 0, 0]])
    config = {"gamma": 0.9, "lam": 0.8}
    a_holed, r_holed = adv.compute_gae_advantage_return(rewards, holed, values=values, config=config)
    a_cut, r_cut = adv.compute_gae_advantage_return(cut_rewards, cut, values=cut_values, config=config)
    torch.testing.assert_close(a_holed[0, keep], a_cut[0, :3], atol=1e-6, rtol=0)
    torch.testing.assert_close(r_holed[0, keep], r_cut[0, :3], atol=1e-6, rtol=0)


def test_gae_needs_values_of_the_right_shape():
    rewards, mask = outcome_rewards([1.0], [2], 3)
    with pytest.raises(ValueError, match=r"gae needs values= \(the critic's value"):
        adv.compute_gae_advantage_return(rewards, mask)
    with pytest.raises(ValueError, match=r"values must be a \(bs, T\) tensor .* got torch.Size\(\[1, 2\]\)"):
        adv.compute_gae_advantage_return(rewards, mask, values=torch.zeros(1, 2))


# ---------------------------------------------------------------- grpo and Dr. GRPO


def test_grpo_hand_computed():
    rewards, mask = outcome_rewards([1, 3, 2, 2, 5, 4], [2, 3, 1, 3, 2, 3], T=3)
    index = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)
    # a: R = 1, 3; mean 2; std = sqrt((1 + 1)/1) = √2        → ∓1/√2 = ∓0.7071068
    # b: R = 2, 2, 5; mean 3; std = sqrt((1 + 1 + 4)/2) = √3  → −1/√3, −1/√3, 2/√3 = −0.5773503, 1.1547005
    # c: a group of one: mean 0, std 1                       → 4
    advantages, returns = adv.compute_grpo_outcome_advantage(rewards, mask, index=index, config=NO_EPS)
    expected = [-0.7071068, 0.7071068, -0.5773503, -0.5773503, 1.1547005, 4.0]
    assert per_sample(advantages) == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(advantages, torch.tensor(expected).unsqueeze(-1) * mask, atol=1e-6, rtol=0)
    assert torch.equal(returns, advantages)


def test_grpo_divides_by_std_plus_epsilon():
    rewards, mask = outcome_rewards([4.0], [1], T=1)
    # 4 / (1 + 1e-6) = 3.999996000004 with the default ε = 1e-6
    assert per_sample(adv.compute_grpo_outcome_advantage(rewards, mask, index=[0])[0]) == pytest.approx(
        [3.999996000004], abs=1e-6
    )
    assert per_sample(
        adv.compute_grpo_outcome_advantage(rewards, mask, index=[0], config={"epsilon": 1.0})[0]
    ) == pytest.approx([2.0])  # 4 / (1 + 1)


def test_grpo_groups_have_zero_mean_and_unit_std():
    torch.manual_seed(2)
    scores = torch.randn(12) * 3 + 1
    rewards, mask = outcome_rewards(scores.tolist(), [1 + i % 4 for i in range(12)], T=4)
    index = torch.tensor([7, 3, 7, 3, 5, 5, 7, 3, 5, 7, 3, 5])
    advantages, _ = adv.compute_grpo_outcome_advantage(rewards, mask, index=index)
    per = advantages[:, 0]
    for group in (3, 5, 7):
        members = per[index == group]
        assert members.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert members.std().item() == pytest.approx(1.0, abs=1e-5)


def test_dr_grpo_is_score_minus_group_mean():
    scores = [1.0, 3.0, 2.0, 2.0, 5.0, 4.0]
    rewards, mask = outcome_rewards(scores, [2, 3, 1, 3, 2, 3], T=3)
    index = ["a", "a", "b", "b", "b", "c"]
    # a: mean 2 → −1, 1;  b: mean 3 → −1, −1, 2;  c (alone): mean 0 → 4
    expected = [-1.0, 1.0, -1.0, -1.0, 2.0, 4.0]
    for config in ({"norm_adv_by_std_in_grpo": False}, AlgorithmConfig(norm_adv_by_std_in_grpo=False)):
        advantages, _ = adv.compute_grpo_outcome_advantage(rewards, mask, index=index, config=config)
        assert per_sample(advantages) == pytest.approx(expected, abs=1e-6)


def test_grpo_needs_an_index_of_batch_length():
    rewards, mask = outcome_rewards([1.0, 2.0], [1, 1], T=1)
    with pytest.raises(ValueError, match=r"grpo needs index= \(one group id per sample"):
        adv.compute_grpo_outcome_advantage(rewards, mask)
    with pytest.raises(ValueError, match=r"index must hold one group id per sample \(2\); got .* \(3,\)"):
        adv.compute_grpo_outcome_advantage(rewards, mask, index=[0, 0, 1])


# ---------------------------------------------------------------- grpo pass@k


def test_grpo_passk_hand_computed():
    rewards, mask = outcome_rewards([1, 3, 2, 5, 5, 0, 4, 1], [1, 2, 3, 1, 2, 3, 1, 2], T=3)
    index = ["a", "a", "a", "b", "b", "c", "c", "c"]
    # a: R = 1, 3, 2: best is 3, runner-up 2 → margin 1; std of (1, 3, 2) = sqrt((1 + 1 + 0)/2) = 1 → 1
    # b: R = 5, 5: a tie; the first one is the best with margin 5 − 5 = 0
    # c: R = 0, 4, 1: margin 4 − 1 = 3; mean 5/3, squares 25/9 + 49/9 + 4/9 = 78/9, var 39/9 = 13/3,
    #    std 2.0816660 → 3 / 2.0816660 = 1.4411534
    advantages, returns = adv.compute_grpo_passk_outcome_advantage(rewards, mask, index=index, config=NO_EPS)
    assert per_sample(advantages) == pytest.approx([0, 1, 0, 0, 0, 0, 1.4411534, 0], abs=1e-6)
    assert torch.equal(returns, advantages)
    unnormalised, _ = adv.compute_grpo_passk_outcome_advantage(
        rewards, mask, index=index, config={"norm_adv_by_std_in_grpo": False}
    )
    assert per_sample(unnormalised) == [0, 1, 0, 0, 0, 0, 3, 0]  # the raw margins


def test_grpo_passk_rejects_a_group_of_one():
    rewards, mask = outcome_rewards([1.0, 2.0, 3.0], [1, 1, 1], T=1)
    with pytest.raises(ValueError, match=r"at least 2 samples per group.*group 'lonely' has 1"):
        adv.compute_grpo_passk_outcome_advantage(rewards, mask, index=["x", "x", "lonely"])


# ---------------------------------------------------------------- rloo


def test_rloo_hand_computed():
    rewards, mask = outcome_rewards([1, 3, 5, 4, 2, 6], [1, 2, 3, 1, 2, 3], T=3)
    index = [0, 0, 0, 1, 2, 2]
    # group 0: 1 − (3 + 5)/2 = −3, 3 − (1 + 5)/2 = 0, 5 − (1 + 3)/2 = 3
    # group 1 (alone): keeps R = 4
    # group 2: 2 − 6 = −4, 6 − 2 = 4
    advantages, returns = adv.compute_rloo_outcome_advantage(rewards, mask, index=index)
    assert per_sample(advantages) == pytest.approx([-3, 0, 3, 4, -4, 4], abs=1e-6)
    assert torch.equal(returns, advantages)


def test_rloo_matches_the_leave_one_out_loop():
    torch.manual_seed(3)
    scores = torch.randn(10)
    index = np.array([1, 2, 1, 3, 2, 1, 2, 4, 1, 3])
    rewards, mask = outcome_rewards(scores.tolist(), [2] * 10, T=2)
    advantages, _ = adv.compute_rloo_outcome_advantage(rewards, mask, index=index)
    for i in range(10):
        others = [scores[j].item() for j in range(10) if j != i and index[j] == index[i]]
        expected = scores[i].item() - (sum(others) / len(others) if others else 0.0)
        assert advantages[i, 0].item() == pytest.approx(expected, abs=1e-6)
        assert advantages[i, 1].item() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------- opo and gpg


def test_opo_hand_computed():
    rewards, mask = outcome_rewards([2, 6, 7], [1, 3, 2], T=3)
    # group a: b = (1·2 + 3·6) / (1 + 3) = 20/4 = 5 → 2 − 5 = −3, 6 − 5 = 1; group b (alone): b = 0 → 7
    advantages, returns = adv.compute_opo_outcome_advantage(rewards, mask, index=["a", "a", "b"])
    assert advantages.tolist() == [[-3, 0, 0], [1, 1, 1], [7, 7, 0]]
    assert torch.equal(returns, advantages)


def test_gpg_hand_computed():
    rewards, mask = outcome_rewards([1, 0, 0, 3, 2], [1, 2, 1, 2, 1], T=2)
    # 3 of 5 scores are nonzero → α = 5/3; means: a 0.5, b 1.5, c (alone) 0
    # α·(R − mean) = 5/3·[0.5, −0.5, −1.5, 1.5, 2] = [0.8333333, −0.8333333, −2.5, 2.5, 3.3333333]
    advantages, _ = adv.compute_gpg_outcome_advantage(rewards, mask, index=["a", "a", "b", "b", "c"])
    assert per_sample(advantages) == pytest.approx([0.8333333, -0.8333333, -2.5, 2.5, 3.3333333], abs=1e-6)
    zeros, _ = adv.compute_gpg_outcome_advantage(torch.zeros(2, 2), torch.ones(2, 2), index=[0, 0])
    assert zeros.tolist() == [[0, 0], [0, 0]]  # no nonzero score: α = 1, no NaN


# ---------------------------------------------------------------- REINFORCE family


def test_reinforce_plus_plus_hand_computed_resets_at_holes():
    rewards = torch.tensor([[0.0, 0.0, 4.0], [2.0, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # γ = 0.5. Row 0: G2 = 4, G1 = 0 + 0.5·4 = 2, G0 = 0 + 0.5·2 = 1.
    # Row 1: G2 = 1, G1 = 0 (tool token: reset), G0 = 2 + 0.5·0 = 2.
    # whiten [1, 2, 4, 2, 1]: mean 2, deviations −1, 0, 2, 0, −1, var 6/4 = 1.5, std 1.2247449
    #   → −1/1.2247449 = −0.8164966, 0, 2/1.2247449 = 1.6329932
    advantages, returns = adv.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config={"gamma": 0.5}
    )
    assert returns.tolist() == [[1, 2, 4], [2, 0, 1]]
    expected = torch.tensor([[-0.8164966, 0.0, 1.6329932], [0.0, 0.0, -0.8164966]])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = outcome_rewards([1, 3, 5], [2, 1, 1], T=2)
    # s = R − mean_g: group a (mean 2) → −1, 1; group c alone (mean 0) → 5
    # on the tokens: [−1, −1 | 1 | 5]: mean 1, deviations −2, −2, 0, 4, squares 24, var 8, std 2√2
    #   → −2/2.8284271 = −0.7071068, 0, 4/2.8284271 = 1.4142136
    advantages, returns = adv.compute_reinforce_plus_plus_baseline_outcome_advantage(
        rewards, mask, index=["a", "a", "c"]
    )
    expected = torch.tensor([[-0.7071068, -0.7071068], [0.0, 0.0], [1.4142136, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert torch.equal(returns, advantages)  # whitened scores for both, as verl


def test_remax_hand_computed():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    # Row 0: the 2 sits on padding and is ignored; reward-to-go [1, 1, 0, 0];
    #   baseline 0.5 → [0.5, 0.5, −0.5, 0]
    # Row 1: reward-to-go [1 + 3, 0, 3, 0] = [4, 0, 3, 0]; baseline 2 → [2, 0, 1, −2]
    advantages, returns = adv.compute_remax_outcome_advantage(
        rewards, mask, reward_baselines=torch.tensor([0.5, 2.0])
    )
    assert returns.tolist() == [[1, 1, 0, 0], [4, 0, 3, 0]]
    assert advantages.tolist() == [[0.5, 0.5, -0.5, 0], [2, 0, 1, -2]]


def test_remax_needs_one_baseline_per_sample():
    rewards, mask = outcome_rewards([1.0, 2.0], [1, 1], T=1)
    with pytest.raises(ValueError, match=r"remax needs reward_baselines= \(the reward of the greedy"):
        adv.compute_remax_outcome_advantage(rewards, mask)
    with pytest.raises(ValueError, match=r"shape \(2,\); got shape \(3,\)"):
        adv.compute_remax_outcome_advantage(rewards, mask, reward_baselines=[0.0, 1.0, 2.0])


# ---------------------------------------------------------------- every estimator


def extras_for(name: str, bs: int, T: int) -> dict:
    values = torch.randn(bs, T)
    return {"values": values} if name == "gae" else {"reward_baselines": torch.randn(bs)}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_is_zero_outside_the_mask_and_ignores_garbage_there(name):
    torch.manual_seed(4)
    bs, T = 6, 5
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 0, 1], [1, 1, 1, 1, 0]]
    )
    rewards = torch.randn(bs, T).masked_fill(mask == 0, float("nan"))
    extra = extras_for(name, bs, T)
    if "values" in extra:
        extra["values"] = extra["values"].masked_fill(mask == 0, float("inf"))
    advantages, returns = ESTIMATORS[name](rewards, mask, index=["p", "q", "p", "q", "p", "q"], **extra)
    for out in (advantages, returns):
        assert out.shape == (bs, T)
        assert torch.isfinite(out).all()
        assert (out[mask == 0] == 0).all()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_checks_its_input_shapes(name):
    with pytest.raises(ValueError, match=r"must both be \(bs, T\); got shapes \(2, 3\) and \(2, 4\)"):
        ESTIMATORS[name](torch.zeros(2, 3), torch.ones(2, 4), index=[0, 0], **extras_for(name, 2, 3))

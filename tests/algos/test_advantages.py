"""Advantage estimators: GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++ (+baseline), ReMax, GPG, GRPO pass@k."""

from __future__ import annotations

import inspect
import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmega.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_dr_grpo_outcome_advantages,
    compute_gae_advantages,
    compute_gpg_outcome_advantages,
    compute_grpo_outcome_advantages,
    compute_grpo_passk_outcome_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_outcome_advantages,
    compute_rloo_outcome_advantages,
    masked_whiten,
    place_scores_at_last_token,
)

from .helpers import PROPERTY_SETTINGS, batch_shapes, garbage_like, make_batch, with_padding

F64 = torch.float64


def _tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# --------------------------------------------------------------------------------------------- GAE

# gamma = 0.9, lambda = 0.8, values (1, 2, 3), reward 1 on the last token:
#   t=2: delta = 1 + 0.9*0 - 3 = -2                         A2 = -2
#   t=1: delta = 0 + 0.9*3 - 2 = 0.7;  A1 = 0.7 + 0.72*(-2)   = -0.74
#   t=0: delta = 0 + 0.9*2 - 1 = 0.8;  A0 = 0.8 + 0.72*(-0.74) = 0.2672
#   returns = A + V = (1.2672, 1.26, 1.0)
GAE_ADVANTAGES = [0.2672, -0.74, -2.0]
GAE_RETURNS = [1.2672, 1.26, 1.0]


def test_gae_by_hand_with_padding_and_hole() -> None:
    rewards = _tensor([[0.0, 0.0, 1.0, 99.0], [0.0, 55.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    values = _tensor([[1.0, 2.0, 3.0, 99.0], [1.0, 77.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    # row 0: trailing padding; row 1: a hole at t=1 (skipped by the recursion); row 2: empty.
    mask = _tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    a0, a1, a2 = GAE_ADVANTAGES
    r0, r1, r2 = GAE_RETURNS
    torch.testing.assert_close(
        advantages, _tensor([[a0, a1, a2, 0.0], [a0, 0.0, a1, a2], [0.0] * 4]), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(returns, _tensor([[r0, r1, r2, 0.0], [r0, 0.0, r1, r2], [0.0] * 4]), rtol=0, atol=1e-12)


def test_gae_lambda_one_gamma_one_is_monte_carlo_minus_value() -> None:
    # reward-to-go (2+1, 1) minus values (0.5, 0.25)
    advantages, returns = compute_gae_advantages(
        _tensor([[2.0, 1.0]]), _tensor([[0.5, 0.25]]), _tensor([[1, 1]]), whiten=False
    )
    torch.testing.assert_close(advantages, _tensor([[2.5, 0.75]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _tensor([[3.0, 1.0]]), rtol=0, atol=1e-12)


def test_gae_whitens_advantages_not_returns() -> None:
    rewards = _tensor([[0.0, 0.0, 1.0, 0.0]])
    values = _tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = _tensor([[1, 1, 1, 0]])
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    raw = torch.tensor(GAE_ADVANTAGES, dtype=F64)
    mean = (0.2672 - 0.74 - 2.0) / 3
    population_variance = sum((x - mean) ** 2 for x in GAE_ADVANTAGES) / 3
    expected = (raw - mean) / math.sqrt(population_variance + 1e-8)
    torch.testing.assert_close(advantages[0, :3], expected, rtol=0, atol=1e-9)
    assert advantages[0, 3].item() == 0.0
    torch.testing.assert_close(returns, _tensor([GAE_RETURNS + [0.0]]), rtol=0, atol=1e-12)


def test_masked_whiten_by_hand() -> None:
    # valid values 1, 3, 5: mean 3, population variance (4 + 0 + 4) / 3 = 8/3
    values = _tensor([[1.0, 3.0, 42.0], [5.0, -7.0, 0.0]])
    mask = _tensor([[1, 1, 0], [1, 0, 0]])
    scale = 1 / math.sqrt(8 / 3)
    expected = _tensor([[-2 * scale, 0.0, 0.0], [2 * scale, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(values, mask, epsilon=0.0), expected, rtol=0, atol=1e-12)


def test_place_scores_at_last_token_by_hand() -> None:
    mask = _tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    rewards = place_scores_at_last_token(_tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(rewards, _tensor([[0, 2, 0], [0, 0, 3], [0, 0, 0]]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- GRPO and RLOO

# Interleaved groups: a = samples 0, 2, 4 with scores (1, 0, 0); b = samples 1, 3 with (0, 0.5);
# c = sample 5 alone.
SCORES = _tensor([1.0, 0.0, 0.0, 0.5, 0.0, 3.0])
STRING_IDS = ["a", "b", "a", "b", "a", "c"]
TENSOR_IDS = torch.tensor([7, 3, 7, 3, 7, 11])
MASK = _tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])


def _expected_tokens(per_sequence: list[float]) -> torch.Tensor:
    return _tensor(per_sequence).unsqueeze(-1) * MASK


def test_grpo_by_hand() -> None:
    # a: mean 1/3, centred (2/3, -1/3, -1/3), unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    # b: mean 0.25, centred (-0.25, 0.25), unbiased std sqrt(0.125)
    # c: singleton -> 0
    std_a, std_b = math.sqrt(1 / 3), math.sqrt(0.125)
    eps = 1e-6
    expected = [
        (2 / 3) / (std_a + eps),
        -0.25 / (std_b + eps),
        (-1 / 3) / (std_a + eps),
        0.25 / (std_b + eps),
        (-1 / 3) / (std_a + eps),
        0.0,
    ]
    for group_ids in (STRING_IDS, TENSOR_IDS):
        advantages, returns = compute_grpo_outcome_advantages(SCORES, MASK, group_ids)
        torch.testing.assert_close(advantages, _expected_tokens(expected), rtol=0, atol=1e-12)
        torch.testing.assert_close(returns, _expected_tokens([1.0, 0.0, 0.0, 0.5, 0.0, 3.0]), rtol=0, atol=0)


def test_dr_grpo_by_hand() -> None:
    expected = [2 / 3, -0.25, -1 / 3, 0.25, -1 / 3, 0.0]
    advantages, _ = compute_dr_grpo_outcome_advantages(SCORES, MASK, STRING_IDS)
    torch.testing.assert_close(advantages, _expected_tokens(expected), rtol=0, atol=1e-12)
    same, _ = compute_grpo_outcome_advantages(SCORES, MASK, STRING_IDS, normalize_by_std=False)
    torch.testing.assert_close(same, advantages, rtol=0, atol=0)


def test_grpo_constant_group_is_zero_not_nan() -> None:
    advantages, _ = compute_grpo_outcome_advantages(_tensor([1.0, 1.0]), _tensor([[1], [1]]), ["p", "p"])
    assert torch.equal(advantages, torch.zeros(2, 1, dtype=F64))


def test_grpo_accepts_integer_scores() -> None:
    advantages, _ = compute_grpo_outcome_advantages(torch.tensor([1, 0]), _tensor([[1], [1]]), [0, 0], epsilon=0.0)
    # centred (0.5, -0.5), unbiased std sqrt(0.5) -> +-0.7071
    torch.testing.assert_close(advantages, torch.tensor([[0.5**0.5], [-(0.5**0.5)]]), rtol=0, atol=1e-6)


def test_rloo_by_hand() -> None:
    # a: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice). b: 0 - 0.5 = -0.5; 0.5 - 0 = 0.5. c: 0.
    expected = [1.0, -0.5, -0.5, 0.5, -0.5, 0.0]
    advantages, returns = compute_rloo_outcome_advantages(SCORES, MASK, TENSOR_IDS)
    torch.testing.assert_close(advantages, _expected_tokens(expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _expected_tokens(SCORES.tolist()), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_by_hand() -> None:
    # gamma = 0.5. Row 0 rewards (0, 0, 1) -> returns (0.25, 0.5, 1); row 1 (0, 2) -> (1, 2).
    # Whitening over the 5 valid returns: mean 4.75/5 = 0.95, deviations (-0.7, -0.45, 0.05, 0.05,
    # 1.05), population variance 1.8/5 = 0.36, std 0.6.
    rewards = _tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 123.0]])
    mask = _tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, _tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), rtol=0, atol=1e-12)
    expected = _tensor([[-0.7 / 0.6, -0.45 / 0.6, 0.05 / 0.6], [0.05 / 0.6, 1.05 / 0.6, 0.0]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-7)


def test_reinforce_plus_plus_discount_skips_holes() -> None:
    # the masked middle token neither adds its reward nor costs a discount step: (0.5, -, 1)
    _, returns = compute_reinforce_plus_plus_advantages(_tensor([[0.0, 8.0, 1.0]]), _tensor([[1, 0, 1]]), gamma=0.5)
    torch.testing.assert_close(returns, _tensor([[0.5, 0.0, 1.0]]), rtol=0, atol=1e-12)


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # groups a = (1, 0) -> centred (0.5, -0.5); b = (0.5, 0.5) -> (0, 0). 2 valid tokens each:
    # token values (0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0): mean 0, population variance 1/8.
    scores = _tensor([1.0, 0.0, 0.5, 0.5])
    mask = _tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    advantages, returns = compute_reinforce_plus_plus_baseline_advantages(scores, mask, ["a", "a", "b", "b"])
    scale = 0.5 / math.sqrt(1 / 8)  # = sqrt(2)
    expected = _tensor([[scale, scale, 0], [-scale, -scale, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(returns, scores.unsqueeze(-1) * mask, rtol=0, atol=0)


def test_remax_by_hand() -> None:
    mask = _tensor([[1, 1], [1, 0]])
    rewards = _tensor([[0.0, 1.0], [0.2, 0.0]])  # the scores 1.0 and 0.2 at the last valid tokens
    advantages, returns = compute_remax_outcome_advantages(rewards, _tensor([0.5, 0.7]), mask)
    torch.testing.assert_close(advantages, _tensor([[0.5, 0.5], [-0.5, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, _tensor([[1.0, 1.0], [0.2, 0.0]]), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------ GPG, pass@k


def test_gpg_by_hand() -> None:
    # 3 of the 6 scores are nonzero (1, 0.5, 3): alpha = 6 / 3 = 2, times the group-centred scores
    # (2/3, -1/4, -1/3, 1/4, -1/3, 0); the singleton c gets 0.
    expected = [4 / 3, -0.5, -2 / 3, 0.5, -2 / 3, 0.0]
    for group_ids in (STRING_IDS, TENSOR_IDS):
        advantages, returns = compute_gpg_outcome_advantages(SCORES, MASK, group_ids)
        torch.testing.assert_close(advantages, _expected_tokens(expected), rtol=0, atol=1e-12)
        torch.testing.assert_close(returns, _expected_tokens(SCORES.tolist()), rtol=0, atol=0)


def test_gpg_all_zero_scores_give_zero() -> None:
    advantages, _ = compute_gpg_outcome_advantages(_tensor([0.0, 0.0]), _tensor([[1], [1]]), [0, 0])
    assert torch.equal(advantages, torch.zeros(2, 1, dtype=F64))


def test_grpo_passk_by_hand() -> None:
    # a = (1, 0, 0): sample 0 is best, gap 1 - 0, std sqrt(1/3); b = (0, 0.5): sample 3, gap 0.5,
    # std sqrt(1/8); c: singleton -> 0. Everybody else 0.
    eps = 1e-6
    expected = [1 / (math.sqrt(1 / 3) + eps), 0.0, 0.0, 0.5 / (math.sqrt(0.125) + eps), 0.0, 0.0]
    for group_ids in (STRING_IDS, TENSOR_IDS):
        advantages, returns = compute_grpo_passk_outcome_advantages(SCORES, MASK, group_ids)
        torch.testing.assert_close(advantages, _expected_tokens(expected), rtol=0, atol=1e-12)
        torch.testing.assert_close(returns, _expected_tokens(SCORES.tolist()), rtol=0, atol=0)
    unscaled, _ = compute_grpo_passk_outcome_advantages(SCORES, MASK, STRING_IDS, normalize_by_std=False)
    torch.testing.assert_close(unscaled, _expected_tokens([1.0, 0.0, 0.0, 0.5, 0.0, 0.0]), rtol=0, atol=1e-12)


def test_grpo_passk_tied_best_gives_zero() -> None:
    advantages, _ = compute_grpo_passk_outcome_advantages(_tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), [5, 5, 5])
    assert torch.equal(advantages, torch.zeros(3, 2, dtype=F64))


# ---------------------------------------------------------------------------------- input checks


def test_outcome_estimators_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"scores must be \[B\].*\[6, 3\].*scores \[5\]"):
        compute_grpo_outcome_advantages(SCORES[:5], MASK, STRING_IDS)
    with pytest.raises(ValueError, match="group_ids must have B = 6 entries, got 5"):
        compute_rloo_outcome_advantages(SCORES, MASK, STRING_IDS[:5])
    with pytest.raises(ValueError, match=r"group_ids must be \[B\]"):
        compute_grpo_outcome_advantages(SCORES, MASK, TENSOR_IDS[:4])
    with pytest.raises(ValueError, match="floating-point"):
        compute_grpo_outcome_advantages(SCORES, MASK, TENSOR_IDS.double())
    with pytest.raises(ValueError, match=r"baseline_scores \[2\]"):
        compute_remax_outcome_advantages(torch.zeros_like(MASK), SCORES[:2], MASK)


def test_token_estimators_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"values \[2, 4\]"):
        compute_gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"response_mask \[2\]"):
        compute_reinforce_plus_plus_advantages(torch.zeros(2, 3), torch.ones(2))


def test_registry_has_all_estimators() -> None:
    assert ADVANTAGE_ESTIMATORS["gae"] is compute_gae_advantages
    assert ADVANTAGE_ESTIMATORS["grpo"] is compute_grpo_outcome_advantages
    assert ADVANTAGE_ESTIMATORS["dr_grpo"] is compute_dr_grpo_outcome_advantages
    assert ADVANTAGE_ESTIMATORS["rloo"] is compute_rloo_outcome_advantages
    assert ADVANTAGE_ESTIMATORS["reinforce_plus_plus"] is compute_reinforce_plus_plus_advantages
    assert ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"] is compute_reinforce_plus_plus_baseline_advantages
    assert ADVANTAGE_ESTIMATORS["remax"] is compute_remax_outcome_advantages
    assert ADVANTAGE_ESTIMATORS["gpg"] is compute_gpg_outcome_advantages
    assert ADVANTAGE_ESTIMATORS["grpo_passk"] is compute_grpo_passk_outcome_advantages


# The trainer passes an estimator the inputs its parameters name, from this set only.
ESTIMATOR_INPUTS = {
    "scores", "token_level_rewards", "values", "response_mask", "group_ids", "baseline_scores",
    "gamma", "lam", "normalize_by_std", "epsilon", "whiten", "restart_mask",
}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_estimators_take_only_known_inputs(name: str) -> None:
    parameters = inspect.signature(ADVANTAGE_ESTIMATORS[name]).parameters
    assert set(parameters) <= ESTIMATOR_INPUTS
    assert "response_mask" in parameters


# ------------------------------------------------------------------------------------ properties

group_layouts = st.lists(st.integers(0, 3), min_size=1, max_size=12)  # group id of each sample


def _random_outcome_batch(seed: int, group_of_sample: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch_size = len(group_of_sample)
    # Few distinct score values, as with verifiers, so that constant groups occur.
    scores = torch.randint(0, 3, (batch_size,), generator=generator).to(F64)
    mask = (torch.rand(batch_size, 5, generator=generator) < 0.7).to(F64)
    mask[:, 0] = 1.0  # every sample has a valid first token, so sequence values are readable there
    return scores, mask


@PROPERTY_SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    group_of_sample=group_layouts,
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "gpg"]),
)
def test_group_advantages_have_zero_mean_per_group(seed: int, group_of_sample: list[int], estimator: str) -> None:
    scores, mask = _random_outcome_batch(seed, group_of_sample)
    advantages, _ = ADVANTAGE_ESTIMATORS[estimator](scores, mask, group_of_sample)
    per_sequence = advantages[:, 0]
    for group in set(group_of_sample):
        members = torch.tensor([g == group for g in group_of_sample])
        assert abs(per_sequence[members].mean().item()) < 1e-9
        if members.sum() == 1:
            assert per_sequence[members].item() == 0.0


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), group_of_sample=group_layouts)
@pytest.mark.parametrize(
    "estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "grpo_passk"]
)
def test_group_estimators_are_permutation_equivariant(estimator: str, seed: int, group_of_sample: list[int]) -> None:
    scores, mask = _random_outcome_batch(seed, group_of_sample)
    permutation = torch.randperm(len(group_of_sample), generator=torch.Generator().manual_seed(seed))
    advantages, returns = ADVANTAGE_ESTIMATORS[estimator](scores, mask, group_of_sample)
    permuted_ids = [group_of_sample[i] for i in permutation.tolist()]
    permuted_advantages, permuted_returns = ADVANTAGE_ESTIMATORS[estimator](
        scores[permutation], mask[permutation], permuted_ids
    )
    torch.testing.assert_close(permuted_advantages, advantages[permutation], rtol=0, atol=1e-9)
    torch.testing.assert_close(permuted_returns, returns[permutation], rtol=0, atol=0)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
def test_padding_never_leaks_into_advantages(shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    group_ids = [i % 2 for i in range(batch_size)]
    padding = garbage_like(batch.rewards, seed)
    nan = torch.full_like(padding, float("nan"))

    def all_estimates(rewards: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        outputs = [
            *compute_gae_advantages(rewards, values, batch.mask, gamma=0.9, lam=0.95),
            *compute_reinforce_plus_plus_advantages(rewards, batch.mask, gamma=0.9),
            masked_whiten(values, batch.mask),
        ]
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "grpo_passk"):
            outputs.extend(ADVANTAGE_ESTIMATORS[name](batch.scores, batch.mask, group_ids))
        outputs.extend(compute_remax_outcome_advantages(rewards, batch.scores * 0.5, batch.mask))
        return outputs

    clean = all_estimates(batch.rewards, batch.values)
    for garbage in (padding, nan):
        dirty = all_estimates(
            with_padding(batch.rewards, batch.mask, garbage), with_padding(batch.values, batch.mask, garbage)
        )
        for clean_output, dirty_output in zip(clean, dirty):
            assert torch.equal(dirty_output, clean_output)
            assert torch.equal(clean_output[batch.mask == 0], torch.zeros_like(clean_output[batch.mask == 0]))


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
def test_whitened_advantages_have_zero_mean_unit_variance(shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    advantages, returns = compute_reinforce_plus_plus_advantages(batch.rewards, batch.mask, gamma=0.9)
    valid = advantages[batch.mask.bool()]
    raw_variance = returns[batch.mask.bool()].var(unbiased=False) if valid.numel() else torch.zeros((), dtype=F64)
    # whitening divides by sqrt(var + 1e-8): exactly unit variance up to that epsilon
    expected_variance = (raw_variance / (raw_variance + 1e-8)).item()
    assert abs(valid.sum().item()) < 1e-9
    assert (valid.var(unbiased=False).item() if valid.numel() else 0.0) == pytest.approx(expected_variance, abs=1e-9)


# ------------------------------------------------------------------------ loop references of verl


def _verl_gpg(scores: list[float], group_of_sample: list[int]) -> list[float]:
    """verl's compute_gpg_outcome_advantage as a loop (groups of size >= 2)."""
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    members = defaultdict(list)
    for score, group in zip(scores, group_of_sample):
        members[group].append(score)
    return [alpha * (s - sum(members[g]) / len(members[g])) for s, g in zip(scores, group_of_sample)]


def _verl_grpo_passk(scores: list[float], group_of_sample: list[int], normalize_by_std: bool) -> list[float]:
    """verl's compute_grpo_passk_outcome_advantage as a loop (groups of size >= 2)."""
    advantages = [0.0] * len(scores)
    members = defaultdict(list)
    for i, group in enumerate(group_of_sample):
        members[group].append(i)
    for indices in members.values():
        ranked = sorted(indices, key=lambda i: -scores[i])
        advantage = scores[ranked[0]] - scores[ranked[1]]
        if normalize_by_std:
            mean = sum(scores[i] for i in indices) / len(indices)
            std = math.sqrt(sum((scores[i] - mean) ** 2 for i in indices) / (len(indices) - 1))
            advantage /= std + 1e-6
        advantages[ranked[0]] = advantage
    return advantages


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), group_of_sample=group_layouts, continuous=st.booleans())
@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_gpg_and_grpo_passk_match_verl(
    seed: int, group_of_sample: list[int], continuous: bool, normalize_by_std: bool
) -> None:
    scores, mask = _random_outcome_batch(seed, group_of_sample)
    if continuous:  # distinct scores; otherwise few values with ties and zeros, as from verifiers
        scores = torch.randn(len(scores), generator=torch.Generator().manual_seed(seed), dtype=F64)
    sizes = {g: group_of_sample.count(g) for g in group_of_sample}
    in_pairs = [i for i, g in enumerate(group_of_sample) if sizes[g] >= 2]  # verl's domain
    singletons = [i for i, g in enumerate(group_of_sample) if sizes[g] == 1]

    gpg, _ = compute_gpg_outcome_advantages(scores, mask, group_of_sample)
    expected_gpg = _verl_gpg(scores.tolist(), group_of_sample)
    passk, _ = compute_grpo_passk_outcome_advantages(scores, mask, group_of_sample, normalize_by_std=normalize_by_std)
    subset = [group_of_sample[i] for i in in_pairs]
    expected_passk = _verl_grpo_passk([scores[i].item() for i in in_pairs], subset, normalize_by_std)
    for position, i in enumerate(in_pairs):
        assert gpg[i, 0].item() == pytest.approx(expected_gpg[i], abs=1e-10)
        assert passk[i, 0].item() == pytest.approx(expected_passk[position], abs=1e-10)
    for i in singletons:  # verl: alpha * s for GPG, an error for pass@k; here 0 (no baseline)
        assert gpg[i, 0].item() == 0.0
        assert passk[i, 0].item() == 0.0
    torch.testing.assert_close(gpg, gpg[:, :1] * mask, rtol=0, atol=0)
    torch.testing.assert_close(passk, passk[:, :1] * mask, rtol=0, atol=0)

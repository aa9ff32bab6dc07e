"""rlmega against verl's advantage math, with verl's results worked out by hand in plain Python.

References are verl's code at commit b178a3cd5 (main, 2026-01-29) unless a tag is named: the rejection
before the advantages, ReMax's reward-to-go, DAPO's groups of one and the seq-mean denominators. Each
reference below follows verl's recursion step by step over Python floats (no verl code, no torch).
Batch whitening is the one documented difference left (population variance here, Bessel's in verl), so the
references whiten with the population variance.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlmega.algos import LossDenominators, aggregate_loss, dynamic_sampling_filter
from rlmega.config.schema import AlgorithmConfig
from rlmega.trainer.advantages import compute_advantages

GAMMA, LAM = 0.9, 0.8
LENGTHS = [3, 3, 2, 3]
SCORES = [1.0, 0.0, 1.0, 0.5]
GROUPS = [0, 0, 1, 1]
VALUES = [[0.2, 0.4, 0.6], [0.1, -0.2, 0.3], [0.5, 0.7], [0.0, 0.3, -0.1]]
# The rollout correction's mask: row 0 loses its middle token, row 2 its last one (and with it the score).
KEPT = [[1, 0, 1], [1, 1, 1], [1, 0], [1, 1, 1]]
WIDTH = max(LENGTHS)


def _rows(rows: list[list[float]]) -> list[list[float]]:
    """Right-padded to WIDTH with 0 (verl's padded batch)."""
    return [row + [0.0] * (WIDTH - len(row)) for row in rows]


def _score_rewards() -> list[list[float]]:
    """verl's token_level_scores: each score at the last token of the original response."""
    return _rows([[0.0] * (n - 1) + [s] for n, s in zip(LENGTHS, SCORES)])


def _whiten(rows: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    values = [x for row, m in zip(rows, mask) for x, keep in zip(row, m) if keep]
    mean = sum(values) / len(values)
    variance = sum((x - mean) ** 2 for x in values) / len(values)
    return [[(x - mean) / math.sqrt(variance + 1e-8) if keep else 0.0 for x, keep in zip(row, m)]
            for row, m in zip(rows, mask)]


def verl_gae(rewards: list[list[float]], values: list[list[float]], mask: list[list[int]]):
    """verl/trainer/ppo/core_algos.py:247-258 (compute_gae_advantage_return): a masked position keeps the running
    advantage and next value, so its TD error, reward included, is skipped."""
    advantages, returns = [], []
    for reward, value, keep in zip(rewards, values, mask):
        next_value, last, row = 0.0, 0.0, [0.0] * WIDTH
        for t in reversed(range(WIDTH)):
            candidate = reward[t] + GAMMA * next_value - value[t] + GAMMA * LAM * last
            if keep[t]:
                next_value, last = value[t], candidate
            row[t] = last
        advantages.append(row)
        returns.append([a + v for a, v in zip(row, value)])
    return _whiten(advantages, mask), returns


def verl_reinforce_plus_plus(rewards: list[list[float]], mask: list[list[int]]):
    """core_algos.py:605-613: the return is computed everywhere and then multiplied by the mask, so it restarts
    from 0 before every masked position."""
    returns = []
    for reward, keep in zip(rewards, mask):
        running, row = 0.0, [0.0] * WIDTH
        for t in reversed(range(WIDTH)):
            running = reward[t] + GAMMA * running
            row[t] = running
            running *= keep[t]
        returns.append(row)
    return _whiten(returns, mask), returns


def verl_reinforce_plus_plus_baseline(rewards: list[list[float]], mask: list[list[int]]):
    """core_algos.py:450-473: the summed token rewards minus the group mean, tiled over the mask, whitened."""
    sums = [sum(row) for row in rewards]
    centered = [s - sum(sums[j] for j in range(len(sums)) if GROUPS[j] == g) / GROUPS.count(g)
                for s, g in zip(sums, GROUPS)]
    return _whiten([[c * keep for keep in m] for c, m in zip(centered, mask)], mask)


def verl_grpo(rewards: list[list[float]], mask: list[list[int]], rloo: bool = False):
    """core_algos.py:267-331 (GRPO: Bessel std, epsilon 1e-6) and 477-525 (RLOO), tiled over the mask."""
    sums = [sum(row) for row in rewards]
    out = []
    for s, g, m in zip(sums, GROUPS, mask):
        group = [sums[j] for j in range(len(sums)) if GROUPS[j] == g]
        mean = sum(group) / len(group)
        if rloo:
            advantage = s * len(group) / (len(group) - 1) - mean * len(group) / (len(group) - 1)
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
            advantage = (s - mean) / (std + 1e-6)
        out.append([advantage * keep for keep in m])
    return out


def _ours(estimator: str, reject_first: bool, **config):
    advantages, returns, _ = compute_advantages(
        AlgorithmConfig(adv_estimator=estimator, gamma=GAMMA, lam=LAM, **config), torch.tensor(SCORES), LENGTHS,
        GROUPS, advantage_mask=[torch.tensor(m, dtype=torch.float32) for m in KEPT] if reject_first else None,
        values=[torch.tensor(v) for v in VALUES])
    return _rows([a.tolist() for a in advantages]), _rows([r.tolist() for r in returns])


def _assert_kept_equal(ours: list[list[float]], reference: list[list[float]], atol: float = 1e-6) -> float:
    """Equal on the kept tokens; the largest difference there."""
    largest = 0.0
    for row, want, keep in zip(ours, reference, _rows(KEPT)):
        for value, expected, kept in zip(row, want, keep):
            if kept:
                assert value == pytest.approx(expected, abs=atol)
                largest = max(largest, abs(value - expected))
    return largest


def _largest_kept_difference(ours: list[list[float]], reference: list[list[float]]) -> float:
    return max(abs(a - b) for row, want, keep in zip(ours, reference, _rows(KEPT))
               for a, b, kept in zip(row, want, keep) if kept)


def test_gae_and_reinforce_plus_plus_see_the_rejection_as_verl_does():
    """verl/trainer/ppo/ray_trainer.py:1577-1594: the rollout correction writes the rejected mask into the batch
    (rollout_corr_helper.py:985) before compute_advantage; the token rewards were placed on the response before.
    With reject_before_advantages (the default) rlmega's advantages equal verl's on every kept token; without it
    they are the estimator on the mask before rejection, far from verl's."""
    rewards, kept = _score_rewards(), _rows(KEPT)
    gae_reference, gae_returns = verl_gae(rewards, _rows(VALUES), kept)
    ours, returns = _ours("gae", reject_first=True)
    _assert_kept_equal(ours, gae_reference)
    _assert_kept_equal(returns, gae_returns)
    # Row 2's score sat on its rejected last token: verl's GAE never sees it, so its kept token's return
    # (delta + value = 0 - V_0 + V_0) holds no reward.
    assert returns[2][0] == pytest.approx(0.0, abs=1e-6)

    rpp_reference, rpp_returns = verl_reinforce_plus_plus(rewards, kept)
    ours, returns = _ours("reinforce_plus_plus", reject_first=True)
    _assert_kept_equal(ours, rpp_reference)
    _assert_kept_equal(returns, rpp_returns)
    assert returns[0][0] == 0.0  # the return restarted at row 0's rejected token: the score is lost before it

    baseline_reference = verl_reinforce_plus_plus_baseline(rewards, kept)
    _assert_kept_equal(_ours("reinforce_plus_plus_baseline", reject_first=True)[0], baseline_reference)

    # Advantages on the mask before rejection differ on the kept tokens (the 0.24-2.5).
    assert _largest_kept_difference(_ours("gae", reject_first=False)[0], gae_reference) > 0.2
    assert _largest_kept_difference(_ours("reinforce_plus_plus", reject_first=False)[0], rpp_reference) > 0.2
    assert _largest_kept_difference(
        _ours("reinforce_plus_plus_baseline", reject_first=False)[0], baseline_reference) > 0.2


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_outcome_estimators_are_the_same_in_both_orders(estimator):
    """core_algos.py:267-331 (GRPO) and 477-525 (RLOO): the summed rewards, tiled over the mask; the rejection only
    chooses where they are tiled."""
    reference = verl_grpo(_score_rewards(), _rows(KEPT), rloo=estimator == "rloo")
    for reject_first in (True, False):
        _assert_kept_equal(_ours(estimator, reject_first)[0], reference)


def test_remax_with_kl_in_the_reward_is_the_reward_to_go_minus_the_baseline():
    """ray_trainer.py:70-105 (apply_kl_penalty: r_t = score_t - beta * kl_t over the response) and
    core_algos.py:650-652 (compute_remax_outcome_advantage: reverse cumulative sum of r * mask, minus the
    baseline on every valid token). k1 KL, beta = 0.1."""
    old = [[-0.5, -1.0, -0.2], [-0.3, -0.7, -0.9], [-1.2, -0.4], [-0.6, -0.1, -0.8]]
    ref = [[-0.7, -0.4, -0.2], [-0.1, -1.5, -0.5], [-0.2, -0.9], [-0.6, -0.6, -0.3]]
    baseline = [0.5, 0.25, 1.0, 0.0]
    rewards = [[0.0] * (n - 1) + [s] for n, s in zip(LENGTHS, SCORES)]
    expected = []
    for row, o, r, b in zip(rewards, old, ref, baseline):
        penalised = [x - 0.1 * (a - c) for x, a, c in zip(row, o, r)]
        expected.append([sum(penalised[t:]) - b for t in range(len(row))])
    advantages, returns, _ = compute_advantages(
        AlgorithmConfig(adv_estimator="remax", kl_in_reward_coef=0.1), torch.tensor(SCORES), LENGTHS, GROUPS,
        kl_estimator="k1", old_logp=[torch.tensor(o) for o in old], ref_logp=[torch.tensor(r) for r in ref],
        baseline_scores=torch.tensor(baseline))
    for ours, want, b in zip(advantages, expected, baseline):
        torch.testing.assert_close(ours, torch.tensor(want), rtol=0, atol=1e-6)
    for ours, want, b in zip(returns, expected, baseline):
        torch.testing.assert_close(ours, torch.tensor(want) + b, rtol=0, atol=1e-6)
    # Not the summed score on every token: the first tokens of row 1 carry penalties the last one does not.
    assert advantages[1][0] != pytest.approx(float(advantages[1][-1]), abs=1e-3)


def test_dynamic_sampling_keeps_a_group_of_one():
    """recipe/dapo/dapo_ray_trainer.py:258 at v0.7.0: a prompt is kept when the std of its metric is > 0 or it has
    a single response."""
    group_ids = ["a", "a", "b", "c", "c", "d"]
    metric = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    values = {uid: [float(metric[i]) for i, g in enumerate(group_ids) if g == uid] for uid in group_ids}
    kept_by_verl = [uid for uid, vals in values.items() if len(vals) == 1 or len(set(vals)) > 1]
    assert kept_by_verl == ["b", "c", "d"]
    result = dynamic_sampling_filter(group_ids, metric)
    assert result.keep_mask.tolist() == [g in kept_by_verl for g in group_ids]
    assert (result.num_kept_groups, result.num_dropped_groups) == (3, 1)


def test_seq_mean_denominators_against_the_nominal_mini_batch():
    """core_algos.py:1059-1072 (agg_loss, seq-mean-token-mean: sum of the per-sequence token means /
    global_batch_size) with ray_trainer.py:1246-1254 (global_batch_size = ppo_mini_batch_size * rollout.n, the
    nominal size, fully masked rows included). rlmega divides by the sequences with a valid token instead, so
    verl's value is rlmega's times N_seq / nominal (rlmega/algos/README.md, "Seq-mean denominators")."""
    losses = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [5.0, 7.0, 9.0], [4.0, 4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float64)  # row 1 fully masked
    nominal = 4
    verl = ((1 + 3) / 2 + (5 + 7 + 9) / 3 + 4 / 1) / nominal
    ours = aggregate_loss(losses, mask, "seq-mean-token-mean",
                          global_denominators=LossDenominators(mask.sum(), torch.tensor(3)))
    assert float(ours) == pytest.approx(verl * nominal / 3, abs=1e-12)
    assert float(ours) * 3 / nominal == pytest.approx(verl, abs=1e-12)

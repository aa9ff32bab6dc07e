"""The trainer's advantages of a multi-turn batch: token-level estimators see the policy's tokens only."""

from __future__ import annotations

import math

import torch

from rlmega.config.schema import AlgorithmConfig
from rlmega.trainer.advantages import compute_advantages

# One trajectory of 5 response tokens: a policy turn (2 tokens), a tool output (2 masked tokens), the answer.
POLICY_MASK = [torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])]
VALUES = [torch.tensor([0.5, 1.0, 9.0, -9.0, 2.0])]


def test_gae_bootstraps_over_policy_tokens_only():
    config = AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    advantages, returns, metrics = compute_advantages(config, torch.tensor([1.0]), [5], [0],
                                                      response_mask=POLICY_MASK, values=VALUES)
    # Worked by hand in tests/algos/test_advantages_policy_tokens.py: the compacted returns (0.9576, 1.08, 1).
    torch.testing.assert_close(returns[0], torch.tensor([0.9576, 1.08, 0.0, 0.0, 1.0]), rtol=0, atol=1e-6)
    # Whitened over the 3 policy tokens: raw (0.4576, 0.08, -1), mean -0.1541(3), population std 0.6179.
    raw = torch.tensor([0.4576, 0.08, -1.0], dtype=torch.float64)
    whitened = (raw - raw.mean()) / (raw.var(unbiased=False) + 1e-8).sqrt()
    expected = torch.tensor([whitened[0], whitened[1], 0.0, 0.0, whitened[2]], dtype=torch.float32)
    torch.testing.assert_close(advantages[0], expected, rtol=0, atol=1e-5)
    assert math.isclose(metrics["critic/rewards/mean"], 1.0)


def test_without_a_mask_every_token_counts_as_before():
    config = AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    unmasked = compute_advantages(config, torch.tensor([1.0]), [5], [0], values=VALUES)
    all_ones = compute_advantages(config, torch.tensor([1.0]), [5], [0], values=VALUES,
                                  response_mask=[torch.ones(5)])
    masked = compute_advantages(config, torch.tensor([1.0]), [5], [0], values=VALUES, response_mask=POLICY_MASK)
    assert torch.equal(unmasked[0][0], all_ones[0][0]) and torch.equal(unmasked[1][0], all_ones[1][0])
    assert not torch.allclose(unmasked[1][0], masked[1][0])


def test_a_response_masked_whole_keeps_its_score_in_its_group():
    # Overlong filtering masks the second response whole; GRPO's group still holds its score 0.
    config = AlgorithmConfig(adv_estimator="grpo")
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.zeros(2)]
    advantages, _, metrics = compute_advantages(config, torch.tensor([1.0, 0.0]), [3, 2], [0, 0],
                                                response_mask=masks)
    centred = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / (Bessel std of (1, 0) + eps)
    torch.testing.assert_close(advantages[0], torch.tensor([centred, 0.0, centred]), rtol=0, atol=1e-6)
    torch.testing.assert_close(advantages[1], torch.zeros(2))
    assert math.isclose(metrics["critic/rewards/mean"], 0.5)


def test_every_response_masked_whole_gives_metrics_not_an_error():
    config = AlgorithmConfig(adv_estimator="reinforce_plus_plus")
    advantages, _, metrics = compute_advantages(config, torch.tensor([1.0]), [2], [0], response_mask=[torch.zeros(2)])
    assert torch.equal(advantages[0], torch.zeros(2)) and metrics["critic/advantages/max"] == 0.0

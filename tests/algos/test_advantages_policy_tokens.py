"""Token-level estimators over the policy's tokens only: a masked span (tool output, template glue) is absent.

GAE and REINFORCE++ on a response with holes equal the same estimator on the compacted policy-only sequence,
scattered back, with 0 at the masked positions; the numbers below are worked by hand.
"""

from __future__ import annotations

import pytest
import torch

from rlmega.algos import compute_gae_advantages, compute_reinforce_plus_plus_advantages

F64 = torch.float64

# Five response tokens: two policy tokens, two masked tool-output tokens (their rewards and values are
# garbage that must not matter), then the policy's last token, which holds the score 1.
MASK = torch.tensor([[1, 1, 0, 0, 1]], dtype=F64)
REWARDS = torch.tensor([[0.0, 0.0, 5.0, 7.0, 1.0]], dtype=F64)
VALUES = torch.tensor([[0.5, 1.0, 9.0, -9.0, 2.0]], dtype=F64)


def _scatter(policy_values: list[float]) -> torch.Tensor:
    """Policy-token values back at the positions 0, 1 and 4, 0 at the masked 2 and 3."""
    first, second, last = policy_values
    return torch.tensor([[first, second, 0.0, 0.0, last]], dtype=F64)


# gamma = 1, lambda = 1 on the compacted (r, V) = ((0, 0, 1), (0.5, 1, 2)):
#   p=2: delta = 1 + 0 - 2 = -1                 A = -1
#   p=1: delta = 0 + 2 - 1 = 1                  A = 1 + (-1)  = 0
#   p=0: delta = 0 + 1 - 0.5 = 0.5              A = 0.5 + 0   = 0.5
#   returns = A + V = (1, 1, 1): the Monte-Carlo return of every policy token.
# gamma = 0.9, lambda = 0.8 (gamma * lambda = 0.72), one discount step per policy token:
#   p=2: delta = 1 + 0.9 * 0 - 2 = -1           A = -1
#   p=1: delta = 0 + 0.9 * 2 - 1 = 0.8          A = 0.8 + 0.72 * (-1)  = 0.08
#   p=0: delta = 0 + 0.9 * 1 - 0.5 = 0.4        A = 0.4 + 0.72 * 0.08  = 0.4576
#   returns = (0.9576, 1.08, 1.0)
@pytest.mark.parametrize("gamma, lam, advantages, returns", [
    (1.0, 1.0, [0.5, 0.0, -1.0], [1.0, 1.0, 1.0]),
    (0.9, 0.8, [0.4576, 0.08, -1.0], [0.9576, 1.08, 1.0]),
])
def test_gae_skips_tool_tokens_by_hand(gamma, lam, advantages, returns) -> None:
    got_advantages, got_returns = compute_gae_advantages(REWARDS, VALUES, MASK, gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(got_advantages, _scatter(advantages), rtol=0, atol=1e-12)
    torch.testing.assert_close(got_returns, _scatter(returns), rtol=0, atol=1e-12)


def test_gae_through_the_tool_tokens_would_differ() -> None:
    # The same response with every token counted: the tool tokens' values bootstrap the policy's second token.
    everything = torch.ones_like(MASK)
    through, _ = compute_gae_advantages(REWARDS, VALUES, everything, gamma=0.9, lam=0.8, whiten=False)
    skipping, _ = compute_gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8, whiten=False)
    assert not torch.allclose(through[MASK.bool()], skipping[MASK.bool()])


def test_reinforce_plus_plus_returns_skip_tool_tokens_by_hand() -> None:
    # gamma = 0.9 over the compacted rewards (0, 0, 1): G = (0.81, 0.9, 1).
    _, returns = compute_reinforce_plus_plus_advantages(REWARDS, MASK, gamma=0.9)
    torch.testing.assert_close(returns, _scatter([0.81, 0.9, 1.0]), rtol=0, atol=1e-12)


def _compacted_then_scattered(estimator, rewards, values, mask, **kwargs):
    """Each row's policy tokens run alone (one row, no holes), scattered back; 0 elsewhere."""
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        keep = mask[row].bool()
        if not keep.any():
            continue
        inputs = [rewards[row, keep][None]] + ([] if values is None else [values[row, keep][None]])
        row_advantages, row_returns = estimator(*inputs, torch.ones(1, int(keep.sum()), dtype=F64), **kwargs)
        advantages[row, keep], returns[row, keep] = row_advantages[0], row_returns[0]
    return advantages, returns


@pytest.mark.parametrize("seed", range(5))
def test_masked_estimators_equal_the_compacted_sequence(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 9, generator=generator, dtype=F64)
    values = torch.randn(4, 9, generator=generator, dtype=F64)
    mask = (torch.rand(4, 9, generator=generator) < 0.6).to(F64)
    mask[0] = 0.0  # a response masked whole
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.95, lam=0.7, whiten=False)
    expected = _compacted_then_scattered(compute_gae_advantages, rewards, values, mask, gamma=0.95, lam=0.7,
                                         whiten=False)
    torch.testing.assert_close(advantages, expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, expected[1], rtol=0, atol=1e-12)
    _, returns = compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    expected_returns = _compacted_then_scattered(compute_reinforce_plus_plus_advantages, rewards, None, mask,
                                                 gamma=0.9)[1]
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-12)

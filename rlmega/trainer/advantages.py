"""From scored responses to per-token advantages (and returns), by the configured algorithm."""

from __future__ import annotations

from typing import Optional

import torch

from rlmega import algos
from rlmega.config.schema import AlgorithmConfig
from rlmega.workers.batching import padded_field


def compute_advantages(
    config: AlgorithmConfig, scores: torch.Tensor, response_lengths: list[int], group_ids: list[int], *,
    old_logp: Optional[list[torch.Tensor]] = None, ref_logp: Optional[list[torch.Tensor]] = None,
    values: Optional[list[torch.Tensor]] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sequence ``[R_i]`` advantages and returns, and metrics (e.g. the KL in the reward)."""
    _, mask = padded_field([torch.ones(n) for n in response_lengths])
    group_index = torch.tensor(group_ids)
    metrics: dict[str, float] = {}
    token_rewards = algos.place_scores_at_last_token(scores, mask)
    if config.kl_in_reward_coef > 0:
        token_rewards, kl_metrics = algos.apply_kl_penalty(
            scores, padded_field(old_logp)[0], padded_field(ref_logp)[0], mask,
            kl_coef=config.kl_in_reward_coef, estimator=config.kl_estimator,
        )
        metrics.update({f"critic/{name}": float(value) for name, value in kl_metrics.items()})
    name = config.name
    if name in ("grpo", "dapo"):
        advantages, returns = algos.compute_grpo_outcome_advantages(
            scores, mask, group_index, normalize_by_std=config.norm_adv_by_std)
    elif name == "rloo":
        advantages, returns = algos.compute_rloo_outcome_advantages(scores, mask, group_index)
    elif name == "reinforce_plus_plus":
        advantages, returns = algos.compute_reinforce_plus_plus_advantages(token_rewards, mask, gamma=config.gamma)
    elif name == "ppo":
        advantages, returns = algos.compute_gae_advantages(
            token_rewards, padded_field(values)[0], mask, gamma=config.gamma, lam=config.lam)
    else:
        raise ValueError(f"algorithm.name={name!r} has no advantage estimator here")
    metrics["critic/advantages/mean"] = float(advantages[mask].mean())
    metrics["critic/advantages/max"] = float(advantages[mask].max())
    metrics["critic/advantages/min"] = float(advantages[mask].min())
    metrics["critic/rewards/mean"] = float(token_rewards.sum(-1).mean())
    unpadded = lambda tensor: [row[:n].clone() for row, n in zip(tensor, response_lengths)]  # noqa: E731
    return unpadded(advantages), unpadded(returns), metrics

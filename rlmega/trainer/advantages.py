"""From scored responses to per-token advantages (and returns), by the estimator the config names.

The estimator is looked up in ``rlmega.algos.ADVANTAGE_ESTIMATORS`` and called with the inputs its
signature asks for, so every estimator of the library is one config value away:

- ``token_level_rewards [B, T]``: the score at the last response token, minus ``kl_in_reward_coef *
  KL(actor || ref)`` per token when that coefficient is set;
- ``scores [B]``: each response's outcome, the sum of its token rewards (so the KL in the reward
  reaches outcome estimators too, as in verl: GRPO / RLOO see the penalised return);
- ``values`` (gae), ``group_ids`` (group estimators), ``baseline_scores`` (remax's greedy response),
  ``gamma``, ``lam``, ``normalize_by_std`` from ``AlgorithmConfig``.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from rlmega import algos
from rlmega.config.schema import AlgorithmConfig
from rlmega.workers.batching import padded_field

# Estimator inputs taken from AlgorithmConfig (estimator parameter -> config field); the others
# (epsilon, whiten) keep the estimator's default.
CONFIG_INPUTS = {"gamma": "gamma", "lam": "lam", "normalize_by_std": "norm_adv_by_std"}


def estimator_inputs(name: str) -> set[str]:
    """The names of the inputs estimator ``name`` takes (a ValueError lists the valid names)."""
    return set(inspect.signature(algos.get_advantage_estimator(name)).parameters)


def compute_advantages(
    config: AlgorithmConfig, scores: torch.Tensor, response_lengths: list[int], group_ids: list[int], *,
    kl_estimator: str = "k1", old_logp: Optional[list[torch.Tensor]] = None,
    ref_logp: Optional[list[torch.Tensor]] = None, values: Optional[list[torch.Tensor]] = None,
    baseline_scores: Optional[torch.Tensor] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sequence ``[R_i]`` advantages and returns, and metrics (the rewards, the KL in them)."""
    _, mask = padded_field([torch.ones(n) for n in response_lengths])
    metrics: dict[str, float] = {}
    token_rewards = algos.place_scores_at_last_token(scores, mask)
    if config.kl_in_reward_coef > 0:
        token_rewards, kl_metrics = algos.apply_kl_penalty(
            scores, padded_field(old_logp)[0], padded_field(ref_logp)[0], mask,
            kl_coef=config.kl_in_reward_coef, estimator=kl_estimator,
        )
        metrics.update({f"critic/{name}": float(value) for name, value in kl_metrics.items()})
    available = {
        "token_level_rewards": token_rewards, "scores": token_rewards.sum(dim=-1), "response_mask": mask,
        "group_ids": torch.tensor(group_ids), "values": None if values is None else padded_field(values)[0],
        "baseline_scores": baseline_scores, **{name: getattr(config, field) for name, field in CONFIG_INPUTS.items()},
    }
    estimator = algos.get_advantage_estimator(config.adv_estimator)
    kwargs = {}
    for name, parameter in inspect.signature(estimator).parameters.items():
        if available.get(name) is not None:
            kwargs[name] = available[name]
        elif parameter.default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator {config.adv_estimator!r} needs {name}, which this run does not "
                             "produce (gae needs the critic, remax its greedy baseline)")
    advantages, returns = estimator(**kwargs)
    metrics["critic/advantages/mean"] = float(advantages[mask].mean())
    metrics["critic/advantages/max"] = float(advantages[mask].max())
    metrics["critic/advantages/min"] = float(advantages[mask].min())
    sequence_rewards = token_rewards.sum(-1)
    metrics["critic/rewards/mean"] = float(sequence_rewards.mean())
    metrics["critic/rewards/max"] = float(sequence_rewards.max())
    metrics["critic/rewards/min"] = float(sequence_rewards.min())
    unpadded = lambda tensor: [row[:n].clone() for row, n in zip(tensor, response_lengths)]  # noqa: E731
    return unpadded(advantages), unpadded(returns), metrics

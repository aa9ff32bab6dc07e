"""From scored responses to per-token advantages (and returns), by the estimator the config names.

The estimator is looked up in ``rlmega.algos.ADVANTAGE_ESTIMATORS`` and called with the inputs its
signature asks for, so every estimator of the library is one config value away:

- ``token_level_rewards [B, T]``: the score at the last response token, minus ``kl_in_reward_coef *
  KL(actor || ref)`` per token when that coefficient is set; with ``turn_rewards`` (an environment's reward per
  turn, already inside the score) those sit at their turns' last policy tokens and the rest of the score at the
  last one;
- ``response_mask [B, T]``: the rollouts' loss mask when they have one (an agent's policy tokens, overlong
  filtering), else every response token. Token-level estimators run over its tokens only: GAE's values and
  bootstrapping, REINFORCE++'s returns and the whitening skip tool output and template glue (a masked token gets
  advantage 0 and return 0), the score sits at the last policy token and the KL in the reward counts policy tokens;
- ``scores [B]``: each response's outcome, the sum of its token rewards (so the KL in the reward
  reaches outcome estimators too, as in verl: GRPO / RLOO see the penalised return); a response masked whole
  keeps its score, so it still counts in its group's baseline;
- with ``advantage_mask`` (the rollout correction's mask after rejection,
  ``algorithm.rollout_correction.reject_before_advantages``): rewards are placed, and the KL in the reward
  taken, on ``response_mask`` as before, but the estimator runs on ``advantage_mask``, as verl's does once its
  rejection has narrowed the batch's mask: GAE skips the rejected tokens and their rewards, REINFORCE++
  restarts its return at them (``restart_mask``), whitening and ReMax's reward-to-go leave them out;
- ``values`` (gae), ``group_ids`` (group estimators), ``baseline_scores`` (remax's greedy response),
  ``gamma``, ``lam``, ``normalize_by_std`` from ``AlgorithmConfig``.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from rlmega import algos
from rlmega.config.schema import AlgorithmConfig
from rlmega.workers.batching import padded_field, padding_mask

# Estimator inputs taken from AlgorithmConfig (estimator parameter -> config field); the others
# (epsilon, whiten) keep the estimator's default.
CONFIG_INPUTS = {"gamma": "gamma", "lam": "lam", "normalize_by_std": "norm_adv_by_std"}


def estimator_inputs(name: str) -> set[str]:
    """The names of the inputs estimator ``name`` takes (a ValueError lists the valid names)."""
    return set(inspect.signature(algos.get_advantage_estimator(name)).parameters)


def compute_advantages(
    config: AlgorithmConfig, scores: torch.Tensor, response_lengths: list[int], group_ids: list[int], *,
    response_mask: Optional[list[torch.Tensor]] = None, advantage_mask: Optional[list[torch.Tensor]] = None,
    kl_estimator: str = "k1",
    old_logp: Optional[list[torch.Tensor]] = None,
    ref_logp: Optional[list[torch.Tensor]] = None, values: Optional[list[torch.Tensor]] = None,
    baseline_scores: Optional[torch.Tensor] = None, turn_rewards: Optional[list[torch.Tensor]] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sequence ``[R_i]`` advantages and returns, and metrics (the rewards, the KL in them).

    ``response_mask`` (per sequence ``[R_i]``, nonzero on the tokens that train) defaults to every token;
    ``advantage_mask`` (per sequence ``[R_i]``, within ``response_mask``), the mask the estimator runs on,
    defaults to ``response_mask``.
    ``turn_rewards`` (per sequence ``[R_i]``) are the parts of ``scores`` that belong at earlier tokens (0 elsewhere);
    where the mask drops such a token its reward joins the rest of the score at the last token."""
    lengths_mask = padding_mask(response_lengths)
    mask = lengths_mask if response_mask is None else padded_field(response_mask)[0].ne(0) & lengths_mask
    metrics: dict[str, float] = {}
    at_turns = None if turn_rewards is None else torch.where(mask, padded_field(turn_rewards)[0], 0.0)
    at_last = scores if at_turns is None else scores - at_turns.sum(dim=-1)
    token_rewards = algos.place_scores_at_last_token(at_last, mask)
    if config.kl_in_reward_coef > 0:
        token_rewards, kl_metrics = algos.apply_kl_penalty(
            at_last, padded_field(old_logp)[0], padded_field(ref_logp)[0], mask,
            kl_coef=config.kl_in_reward_coef, estimator=kl_estimator,
        )
        metrics.update({f"critic/{name}": float(value) for name, value in kl_metrics.items()})
    if at_turns is not None:
        token_rewards = token_rewards + at_turns.to(token_rewards.dtype)
    # A response masked whole (filtered) holds no token reward, but its score still counts in its group.
    masked_whole = lengths_mask.any(dim=-1) & ~mask.any(dim=-1)
    sequence_rewards = token_rewards.sum(dim=-1) + torch.where(masked_whole, scores.to(token_rewards.dtype), 0.0)
    estimated = mask if advantage_mask is None else padded_field(advantage_mask)[0].ne(0) & mask
    available = {
        "token_level_rewards": token_rewards, "scores": sequence_rewards, "response_mask": estimated,
        "restart_mask": None if advantage_mask is None else mask & ~estimated,
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
    trained = advantages[estimated] if estimated.any() else advantages.new_zeros(1)
    metrics["critic/advantages/mean"] = float(trained.mean())
    metrics["critic/advantages/max"] = float(trained.max())
    metrics["critic/advantages/min"] = float(trained.min())
    metrics["critic/rewards/mean"] = float(sequence_rewards.mean())
    metrics["critic/rewards/max"] = float(sequence_rewards.max())
    metrics["critic/rewards/min"] = float(sequence_rewards.min())
    unpadded = lambda tensor: [row[:n].clone() for row, n in zip(tensor, response_lengths)]  # noqa: E731
    return unpadded(advantages), unpadded(returns), metrics

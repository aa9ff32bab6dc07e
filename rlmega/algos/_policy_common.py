"""Pieces shared by the policy losses: input checks, the log-ratio clamp, PPO clipping, metrics, reduction."""

from __future__ import annotations

from typing import Optional

import torch

from rlmega.algos._utils import check_response_mask, check_same_shape, masked_mean, zero_masked
from rlmega.algos.aggregation import LossDenominators, aggregate_loss

Metrics = dict[str, torch.Tensor]

# exp(20) ~ 4.9e8 is finite in float32 and bfloat16, so a clamped (zero-gradient) token cannot
# turn into 0 * inf = nan in the backward pass. verl clamps PPO's log-ratio to the same range.
DEFAULT_LOG_RATIO_CLAMP = 20.0


def check_policy_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor],
) -> torch.Tensor:
    """Check that every ``[B, T]`` input has the same shape; return the mask as bool."""
    tensors = dict(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask)
    if rollout_is_weights is not None:
        tensors["rollout_is_weights"] = rollout_is_weights
    check_same_shape(**tensors)
    return check_response_mask(response_mask)


def check_clip_ratios(clip_ratio_low: Optional[float], clip_ratio_high: float) -> None:
    if clip_ratio_low is not None and not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def clamp_log_ratio(log_ratio: torch.Tensor, log_ratio_clamp: Optional[float]) -> torch.Tensor:
    """``clamp(log_ratio, -c, c)`` before an ``exp``; ``c = None`` leaves it unchanged.

    Outside ``[-c, c]`` the value is pinned and the gradient is 0.
    """
    if log_ratio_clamp is None:
        return log_ratio
    if log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0 or None, got {log_ratio_clamp}")
    return log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` per token, and where each bound is active.

    A bound is active exactly where the clipped term wins, i.e. where the token gets no gradient:
    above ``1 + high`` with ``A > 0``, or below ``1 - low`` with ``A < 0``.
    """
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped_high = (ratio > 1.0 + clip_ratio_high) & (advantages > 0)
    clipped_low = (ratio < 1.0 - clip_ratio_low) & (advantages < 0)
    return torch.maximum(unclipped_loss, clipped_loss), clipped_high, clipped_low


def token_ratio_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_ratio_low: float, clip_ratio_high: float, log_ratio_clamp: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped surrogate from log-probs: ``(log_ratio, advantages, per_token_loss, clipped_high,
    clipped_low)``, with padding zeroed, the old log-probs and advantages detached and the log-ratio clamped."""
    log_ratio = zero_masked(logp - old_logp.detach(), mask)
    ratio = torch.exp(clamp_log_ratio(log_ratio, log_ratio_clamp))
    advantages = zero_masked(advantages.detach(), mask)
    per_token_loss, clipped_high, clipped_low = clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return log_ratio, advantages, per_token_loss, clipped_high, clipped_low


def kl_metric(log_ratio: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``ppo_kl``: mean of ``old_logp - logp`` over the valid tokens; ``log_ratio = logp - old_logp``."""
    return {"ppo_kl": masked_mean(-log_ratio, mask)}


def clip_metrics(
    log_ratio: torch.Tensor, clipped_high: torch.Tensor, clipped_low: torch.Tensor, mask: torch.Tensor
) -> Metrics:
    """``ppo_kl`` and clip fractions over the valid tokens; ``log_ratio = logp - old_logp``."""
    return {
        **kl_metric(log_ratio, mask),
        "pg_clipfrac": masked_mean((clipped_high | clipped_low).to(log_ratio.dtype), mask),
        "pg_clipfrac_high": masked_mean(clipped_high.to(log_ratio.dtype), mask),
        "pg_clipfrac_low": masked_mean(clipped_low.to(log_ratio.dtype), mask),
    }


def reduce_policy_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor],
    loss_agg_mode: str,
    global_denominators: Optional[LossDenominators],
    norm_horizon: Optional[float],
) -> torch.Tensor:
    """Apply the (detached) rollout IS weights per token, then aggregate."""
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * zero_masked(rollout_is_weights.detach(), mask)
    return aggregate_loss(
        per_token_loss,
        mask,
        loss_agg_mode,
        global_denominators=global_denominators,
        norm_horizon=norm_horizon,
    )


def detached(metrics: Metrics) -> Metrics:
    return {name: value.detach() for name, value in metrics.items()}

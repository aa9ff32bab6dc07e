"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv:2505.22617).

Policy entropy falls when tokens with a large covariance between advantage and log-probability
are pushed further. Both losses pick such tokens and restrain them: Clip-Cov drops them from the
PPO loss, KL-Cov adds a ``|log r|`` penalty on them. The per-token covariance is

    cov_t = (A_t - mean(A)) * (logp_t - mean(logp))        (detached)

with the means over the valid tokens *of the call*. A call is one micro-batch (as in verl), so the
selection depends on how the batch was split, and the micro-batch/DP split-invariance of the other
losses cannot hold for these two. The aggregation itself still follows the global-denominator
contract: a selected token stays in the denominators.

Same call, conventions and metrics as ``rlmega.algos.policy_loss`` (where ``POLICY_LOSS_CONFIGS``
registers them).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch

from rlmega.algos._policy_common import check_clip_ratios, clamp_log_ratio, clip_metrics, kl_metric, token_ratio_surrogate
from rlmega.algos._utils import masked_mean, zero_masked
from rlmega.algos.policy_loss_base import RatioLossConfig, keyword_function


def _token_covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A_t - mean(A)) (logp_t - mean(logp))`` with means over the valid tokens; 0 on masked ones."""
    centered_advantages = advantages - masked_mean(advantages, mask)
    centered_logp = logp - masked_mean(logp, mask)
    return zero_masked(centered_advantages * centered_logp, mask)


def _flat_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) indices of the True entries of a ``[B, T]`` bool mask."""
    return mask.flatten().nonzero().squeeze(-1)


def _mark(positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bool tensor shaped like ``like``, True at the given flat indices."""
    marked = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    marked[positions] = True
    return marked.view(like.shape)


@dataclasses.dataclass(frozen=True)
class ClipCovLossConfig(RatioLossConfig):
    """Clip-Cov: PPO's clipped surrogate with a few high-covariance tokens removed.

    Start from ``L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high))``.
    Candidates are the valid tokens that PPO did not clip and whose covariance (module docstring)
    lies strictly inside ``(clip_cov_lb, clip_cov_ub)``. Of them,
    ``k = max(1, floor(clip_cov_ratio * N))`` tokens (``N`` valid tokens of the call; all
    candidates if fewer) are drawn uniformly at random without replacement, and their ``L_t`` is set
    to 0: no value and no gradient, while they still count in the denominators.

    The draw is a ``torch.randperm`` over the candidates in row-major order, taking the first
    ``k``; the context's ``generator`` makes it reproducible (default: torch's global generator).
    Defaults: verl's ``clip_cov_ratio = 2e-4``, ``clip_cov_lb = 1``, ``clip_cov_ub = 5``, and PPO's
    0.2 clip range.

    Metrics: ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low`` (PPO's ratio
    clipping) and ``clip_cov_frac`` (fraction of valid tokens removed by the covariance selection;
    disjoint from the ratio-clipped ones).
    """

    clip_ratio_low: float = 0.2
    """PPO's lower clip range."""
    clip_ratio_high: Optional[float] = None
    """PPO's upper clip range; None: the same as ``clip_ratio_low``."""
    clip_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens to remove (> 0)."""
    clip_cov_lb: float = 1.0
    """Lower end of the open covariance window of the candidates."""
    clip_cov_ub: float = 5.0
    """Upper end of that window."""

    context_fields: ClassVar[tuple[str, ...]] = (*RatioLossConfig.context_fields, "generator")

    @property
    def upper_clip_ratio(self) -> float:
        return self.clip_ratio_low if self.clip_ratio_high is None else self.clip_ratio_high

    def check(self) -> None:
        check_clip_ratios(self.clip_ratio_low, self.upper_clip_ratio)
        if self.clip_cov_ratio <= 0:
            raise ValueError(f"clip_cov_ratio must be > 0, got {self.clip_cov_ratio}")

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio, advantages, per_token_loss, clipped_high, clipped_low = token_ratio_surrogate(
            logp, old_logp, advantages, mask, self.clip_ratio_low, self.upper_clip_ratio, self.log_ratio_clamp)

        covariance = _token_covariance(advantages, zero_masked(logp.detach(), mask), mask)
        candidates = (mask & ~(clipped_high | clipped_low) & (covariance > self.clip_cov_lb)
                      & (covariance < self.clip_cov_ub))
        candidate_positions = _flat_positions(candidates)
        num_to_remove = max(int(self.clip_cov_ratio * int(mask.sum())), 1)
        if candidate_positions.numel() > 0:
            generator = context.generator
            device = generator.device if generator is not None else torch.device("cpu")
            order = torch.randperm(candidate_positions.numel(), generator=generator, device=device)
            candidate_positions = candidate_positions[order[:num_to_remove].to(candidate_positions.device)]
        removed = _mark(candidate_positions, mask)
        per_token_loss = torch.where(removed, torch.zeros_like(per_token_loss), per_token_loss)

        metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
        metrics["clip_cov_frac"] = masked_mean(removed.to(log_ratio.dtype), mask)
        return self.reduce(per_token_loss, mask, context), metrics


@dataclasses.dataclass(frozen=True)
class KLCovLossConfig(RatioLossConfig):
    """KL-Cov: the unclipped surrogate ``-A r`` plus a ``|log r|`` penalty on the top-covariance tokens.

    ``S`` is the ``k = max(1, floor(kl_cov_ratio * N))`` valid tokens of the call with the largest
    covariance (module docstring; ties broken as ``torch.topk`` does). With
    ``l_t = logp_t - old_logp_t`` and ``r_t = exp(l_t)``:

        L_t = -A_t r_t + ppo_kl_coef * |l_t| * [t in S]

    There is no ratio clipping: the penalty alone keeps the selected tokens near the old policy.
    The clamp applies to the ``exp`` only; the penalty uses the raw ``|l_t|``. Defaults are verl's
    config values ``kl_cov_ratio = 2e-4``, ``ppo_kl_coef = 0.1``.

    Metrics: ``ppo_kl``, ``ppo_kl_abs`` (mean ``|l_t|``, which verl logs as ``ppo_kl`` for this loss)
    and ``kl_cov_frac`` (fraction of valid tokens penalised).
    """

    kl_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens to penalise, in (0, 1]."""
    ppo_kl_coef: float = 0.1
    """Penalty coefficient (>= 0)."""

    def check(self) -> None:
        if not 0 < self.kl_cov_ratio <= 1:
            raise ValueError(f"kl_cov_ratio must be in (0, 1], got {self.kl_cov_ratio}")
        if self.ppo_kl_coef < 0:
            raise ValueError(f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio = zero_masked(logp - old_logp.detach(), mask)
        ratio = torch.exp(clamp_log_ratio(log_ratio, self.log_ratio_clamp))
        advantages = zero_masked(advantages.detach(), mask)
        per_token_loss = -advantages * ratio

        covariance = _token_covariance(advantages, zero_masked(logp.detach(), mask), mask)
        valid_positions = _flat_positions(mask)
        num_valid = valid_positions.numel()
        if num_valid > 0:
            num_penalised = max(1, int(num_valid * self.kl_cov_ratio))
            top = torch.topk(covariance.flatten()[valid_positions], num_penalised).indices
            valid_positions = valid_positions[top]
        penalised = _mark(valid_positions, mask)
        per_token_loss = torch.where(penalised, per_token_loss + self.ppo_kl_coef * log_ratio.abs(), per_token_loss)

        metrics = kl_metric(log_ratio, mask)
        metrics["ppo_kl_abs"] = masked_mean(log_ratio.abs(), mask)
        metrics["kl_cov_frac"] = masked_mean(penalised.to(log_ratio.dtype), mask)
        return self.reduce(per_token_loss, mask, context), metrics


clip_cov_policy_loss = keyword_function(ClipCovLossConfig)
kl_cov_policy_loss = keyword_function(KLCovLossConfig)

"""Policy losses beyond the PPO clip: REINFORCE / GPG, SAPO's soft gate, GMPO's geometric mean.

Same call, conventions and metrics as ``rlmega.algos.policy_loss`` (where ``POLICY_LOSS_CONFIGS``
registers them): shapes ``[B, T]``, losses to minimise, masking before arithmetic, and the
global-denominator contract of ``aggregate_loss``.
"""

from __future__ import annotations

import dataclasses

import torch

from rlmega.algos._policy_common import clamp_log_ratio, clip_metrics, kl_metric
from rlmega.algos._utils import broadcast_to_tokens, zero_masked
from rlmega.algos.aggregation import aggregate_loss
from rlmega.algos.policy_loss_base import BaseLossConfig, RatioLossConfig, keyword_function


@dataclasses.dataclass(frozen=True)
class ReinforceLossConfig(BaseLossConfig):
    """Plain REINFORCE (Williams 1992), which is also GPG's loss (Chu et al. 2025, arXiv:2504.02546).

        L_t = -A_t logp_t          (times the detached rollout IS weight w_t if given)
        grad L = -(1/N) sum_t w_t A_t grad logp_t       with token-mean over N valid tokens

    No ratio, no clipping: the update is unbiased only on-policy, so use one optimiser step per
    batch, or correct the rollout/trainer mismatch with rollout IS weights. Registered as
    ``gpg`` (verl's ``compute_policy_loss_gpg`` is exactly this loss with ``token-mean``) and as
    ``reinforce`` (verl's ``compute_policy_loss_reinforce`` is the same loss; it defaults to
    ``seq-mean-token-sum``, set ``loss_agg_mode`` for that).

    ``old_logp`` enters only the ``ppo_kl`` metric (the only metric). The loss value depends on
    ``logp`` itself (it is not comparable to PPO's ``-A r``); only its gradient matters.
    """

    def compute(self, logp, old_logp, advantages, mask, context):
        valid_logp = zero_masked(logp, mask)
        per_token_loss = -zero_masked(advantages.detach(), mask) * valid_logp
        metrics = kl_metric(zero_masked(logp - old_logp.detach(), mask), mask)
        return self.reduce(per_token_loss, mask, context), metrics


@dataclasses.dataclass(frozen=True)
class SAPOLossConfig(RatioLossConfig):
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347): a smooth gate instead of a hard clip.

    With ``r_t = exp(logp_t - old_logp_t)`` and ``tau_t = tau_pos`` if ``A_t > 0`` else ``tau_neg``:

        f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau
        L_t       = -f(r_t; tau_t) A_t
        grad L_t  = -4 sigmoid(.) (1 - sigmoid(.)) r_t A_t grad logp_t

    At ``r = 1`` the gradient weight is 1, PPO's; it decays smoothly as ``r`` leaves 1, faster for
    larger ``tau``, so no token is cut off abruptly. The value at ``r = 1`` is ``-2 A / tau`` (not
    ``-A``). Defaults ``tau_pos = 1.0``, ``tau_neg = 1.05`` and ``seq-mean-token-mean`` as verl's.
    Without the log-ratio clamp, a ratio that overflows to ``inf`` gives a ``nan`` gradient.

    Metric: ``ppo_kl``.
    """

    loss_agg_mode: str = "seq-mean-token-mean"
    tau_pos: float = 1.0
    """Gate temperature (> 0) for positive advantages."""
    tau_neg: float = 1.05
    """Gate temperature (> 0) for non-positive advantages."""

    def check(self) -> None:
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={self.tau_pos}, tau_neg={self.tau_neg}")

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio = zero_masked(logp - old_logp.detach(), mask)
        ratio = torch.exp(clamp_log_ratio(log_ratio, self.log_ratio_clamp))
        advantages = zero_masked(advantages.detach(), mask)
        tau = torch.where(advantages > 0, ratio.new_tensor(self.tau_pos), ratio.new_tensor(self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        per_token_loss = -gate * advantages
        return self.reduce(per_token_loss, mask, context), kl_metric(log_ratio, mask)


@dataclasses.dataclass(frozen=True)
class GeoMeanLossConfig(RatioLossConfig):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673).

    The sequence ratio is the geometric mean of the token ratios, each clipped pessimistically in
    log space (``l_t = logp_t - old_logp_t``, ``n_i`` valid tokens, ``A_i`` the mean advantage of
    sequence i):

        l'_t  = min(l_t, clip_ratio_high)      if A_t > 0
              = max(l_t, -clip_ratio_low)      if A_t < 0
              = 0                              if A_t = 0
        L_i   = -A_i exp( (1/n_i) sum_t l'_t )

    i.e. ``sign(A) min(sign(A) l, sign(A) clip(l, -low, high))`` token by token. A token whose
    clip binds gets no gradient; the others get ``-A_i exp(.) / n_i``. GMPO is defined for
    per-sequence advantages (as in verl); token-level advantages are averaged over the sequence.
    The clip range is in log space: the defaults 0.4 / 0.4 are the paper's ``(e^-0.4, e^0.4)``.
    Each ``l_t`` is first clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` so ``exp`` stays finite
    for ``A < 0`` (whose log-ratio is unbounded above).

    ``L_i`` is placed on every valid token of sequence i and aggregated with ``loss_agg_mode``:
    the default ``seq-mean-token-mean`` gives GMPO's mean over sequences, with the usual
    global-denominator contract. The rollout IS weights (positive) are reduced to one weight per
    sequence by their geometric mean over the valid tokens (as verl does), which multiplies ``L_i``.

    Metrics: ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high`` (tokens with ``A > 0`` and
    ``l > high``), ``pg_clipfrac_low`` (``A < 0`` and ``l < -low``).
    """

    loss_agg_mode: str = "seq-mean-token-mean"
    clip_ratio_low: float = 0.4
    """Log-space lower clip bound (>= 0)."""
    clip_ratio_high: float = 0.4
    """Log-space upper clip bound (>= 0)."""

    def check(self) -> None:
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(
                f"clip_ratio_low and clip_ratio_high must be >= 0, got {self.clip_ratio_low}, {self.clip_ratio_high}"
            )

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio = zero_masked(logp - old_logp.detach(), mask)
        clamped_log_ratio = clamp_log_ratio(log_ratio, self.log_ratio_clamp)
        advantages = zero_masked(advantages.detach(), mask)
        pessimistic_log_ratio = torch.where(
            advantages > 0,
            clamped_log_ratio.clamp(max=self.clip_ratio_high),
            torch.where(advantages < 0, clamped_log_ratio.clamp(min=-self.clip_ratio_low), torch.zeros_like(log_ratio)),
        )
        num_valid = mask.sum(dim=-1).clamp(min=1)
        sequence_ratio = torch.exp(pessimistic_log_ratio.sum(dim=-1) / num_valid)
        sequence_advantage = advantages.sum(dim=-1) / num_valid
        sequence_loss = -sequence_advantage * sequence_ratio
        if context.rollout_is_weights is not None:
            log_weights = zero_masked(torch.log(context.rollout_is_weights.detach()), mask)
            sequence_loss = sequence_loss * torch.exp(log_weights.sum(dim=-1) / num_valid)

        clipped_high = (log_ratio > self.clip_ratio_high) & (advantages > 0)
        clipped_low = (log_ratio < -self.clip_ratio_low) & (advantages < 0)
        metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
        loss = aggregate_loss(
            broadcast_to_tokens(sequence_loss, mask),
            mask,
            self.loss_agg_mode,
            global_denominators=context.global_denominators,
            norm_horizon=self.norm_horizon,
        )
        return loss, metrics


reinforce_policy_loss = keyword_function(ReinforceLossConfig)
sapo_policy_loss = keyword_function(SAPOLossConfig)
geo_mean_policy_loss = keyword_function(GeoMeanLossConfig)

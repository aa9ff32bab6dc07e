"""Policy losses beyond the PPO clip: REINFORCE / GPG, SAPO's soft gate, GMPO's geometric mean.

Same signature, conventions and metrics as ``rlmega.algos.policy_loss`` (where ``POLICY_LOSSES``
registers them): shapes ``[B, T]``, losses to minimise, masking before arithmetic, and the
global-denominator contract of ``aggregate_loss``.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlmega.algos._policy_common import (
    DEFAULT_LOG_RATIO_CLAMP,
    Metrics,
    check_policy_inputs,
    clamp_log_ratio,
    clip_metrics,
    detached,
    kl_metric,
    reduce_policy_loss,
)
from rlmega.algos._utils import broadcast_to_tokens, zero_masked
from rlmega.algos.aggregation import LossDenominators, aggregate_loss


def reinforce_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Plain REINFORCE (Williams 1992), which is also GPG's loss (Chu et al. 2025, arXiv:2504.02546).

        L_t = -A_t logp_t          (times the detached ``rollout_is_weights`` w_t if given)
        grad L = -(1/N) sum_t w_t A_t grad logp_t       with token-mean over N valid tokens

    No ratio, no clipping: the update is unbiased only on-policy, so use one optimiser step per
    batch, or correct the rollout/trainer mismatch with ``rollout_is_weights``. Registered as
    ``gpg`` (verl's ``compute_policy_loss_gpg`` is exactly this loss with ``token-mean``) and as
    ``reinforce`` (verl's ``compute_policy_loss_reinforce`` is the same loss; it defaults to
    ``seq-mean-token-sum``, pass ``loss_agg_mode`` for that).

    ``old_logp`` enters only the ``ppo_kl`` metric. The loss value depends on ``logp`` itself (it
    is not comparable to PPO's ``-A r``); only its gradient matters.

    Returns:
        ``(loss, metrics)`` with metric ``ppo_kl``.
    """
    mask = check_policy_inputs(logp, old_logp, advantages, response_mask, rollout_is_weights)
    valid_logp = zero_masked(logp, mask)
    per_token_loss = -zero_masked(advantages.detach(), mask) * valid_logp
    metrics = kl_metric(zero_masked(logp - old_logp.detach(), mask), mask)
    loss = reduce_policy_loss(
        per_token_loss, mask, rollout_is_weights, loss_agg_mode, global_denominators, norm_horizon
    )
    return loss, detached(metrics)


def sapo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: Optional[float] = DEFAULT_LOG_RATIO_CLAMP,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347): a smooth gate instead of a hard clip.

    With ``r_t = exp(logp_t - old_logp_t)`` and ``tau_t = tau_pos`` if ``A_t > 0`` else ``tau_neg``:

        f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau
        L_t       = -f(r_t; tau_t) A_t
        grad L_t  = -4 sigmoid(.) (1 - sigmoid(.)) r_t A_t grad logp_t

    At ``r = 1`` the gradient weight is 1, PPO's; it decays smoothly as ``r`` leaves 1, faster for
    larger ``tau``, so no token is cut off abruptly. The value at ``r = 1`` is ``-2 A / tau`` (not
    ``-A``). Defaults ``tau_pos = 1.0``, ``tau_neg = 1.05`` and ``seq-mean-token-mean`` as verl's.

    Args:
        logp, old_logp, advantages, response_mask: ``[B, T]``.
        tau_pos, tau_neg: gate temperatures (> 0) for positive / non-positive advantages.
        log_ratio_clamp: ``logp - old_logp`` is clamped to ``[-c, c]`` before ``exp``; ``None``
            disables it. Without it, a ratio that overflows to ``inf`` gives a ``nan`` gradient.
        loss_agg_mode, global_denominators, norm_horizon, rollout_is_weights: as in ``ppo_policy_loss``.

    Returns:
        ``(loss, metrics)`` with metric ``ppo_kl``.
    """
    mask = check_policy_inputs(logp, old_logp, advantages, response_mask, rollout_is_weights)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")

    log_ratio = zero_masked(logp - old_logp.detach(), mask)
    ratio = torch.exp(clamp_log_ratio(log_ratio, log_ratio_clamp))
    advantages = zero_masked(advantages.detach(), mask)
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token_loss = -gate * advantages
    metrics = kl_metric(log_ratio, mask)
    loss = reduce_policy_loss(
        per_token_loss, mask, rollout_is_weights, loss_agg_mode, global_denominators, norm_horizon
    )
    return loss, detached(metrics)


def geo_mean_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    log_ratio_clamp: Optional[float] = DEFAULT_LOG_RATIO_CLAMP,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
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

    ``L_i`` is placed on every valid token of sequence i and aggregated with ``loss_agg_mode``:
    the default ``seq-mean-token-mean`` gives GMPO's mean over sequences, with the usual
    global-denominator contract. ``rollout_is_weights`` are reduced to one weight per sequence by
    their geometric mean over the valid tokens (as verl does), which multiplies ``L_i``.

    Args:
        logp, old_logp, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: log-space clip bounds (>= 0).
        log_ratio_clamp: each ``l_t`` is first clamped to ``[-c, c]`` so ``exp`` stays finite for
            ``A < 0`` (whose log-ratio is unbounded above); ``None`` disables it.
        loss_agg_mode, global_denominators, norm_horizon: as in ``ppo_policy_loss``.
        rollout_is_weights: optional ``[B, T]`` positive weights, detached.

    Returns:
        ``(loss, metrics)`` with metrics ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high`` (tokens
        with ``A > 0`` and ``l > high``), ``pg_clipfrac_low`` (``A < 0`` and ``l < -low``).
    """
    mask = check_policy_inputs(logp, old_logp, advantages, response_mask, rollout_is_weights)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low and clip_ratio_high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )

    log_ratio = zero_masked(logp - old_logp.detach(), mask)
    clamped_log_ratio = clamp_log_ratio(log_ratio, log_ratio_clamp)
    advantages = zero_masked(advantages.detach(), mask)
    pessimistic_log_ratio = torch.where(
        advantages > 0,
        clamped_log_ratio.clamp(max=clip_ratio_high),
        torch.where(advantages < 0, clamped_log_ratio.clamp(min=-clip_ratio_low), torch.zeros_like(log_ratio)),
    )
    num_valid = mask.sum(dim=-1).clamp(min=1)
    sequence_ratio = torch.exp(pessimistic_log_ratio.sum(dim=-1) / num_valid)
    sequence_advantage = advantages.sum(dim=-1) / num_valid
    sequence_loss = -sequence_advantage * sequence_ratio
    if rollout_is_weights is not None:
        log_weights = zero_masked(torch.log(rollout_is_weights.detach()), mask)
        sequence_loss = sequence_loss * torch.exp(log_weights.sum(dim=-1) / num_valid)

    clipped_high = (log_ratio > clip_ratio_high) & (advantages > 0)
    clipped_low = (log_ratio < -clip_ratio_low) & (advantages < 0)
    metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
    loss = aggregate_loss(
        broadcast_to_tokens(sequence_loss, mask),
        mask,
        loss_agg_mode,
        global_denominators=global_denominators,
        norm_horizon=norm_horizon,
    )
    return loss, detached(metrics)

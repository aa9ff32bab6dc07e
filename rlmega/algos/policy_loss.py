"""Policy-gradient losses (PPO family, GSPO, CISPO), entropy bonus, and the registries of every policy
loss: ``POLICY_LOSS_CONFIGS`` (name -> config class) and ``POLICY_LOSSES`` (name -> keyword function).
The others live in ``policy_loss_extra`` (REINFORCE/GPG, SAPO, GMPO) and ``policy_loss_cov`` (Clip-Cov,
KL-Cov); what they share in ``policy_loss_base``.

Log-probabilities, all ``[B, T]`` log pi(y_t | y_<t) of the sampled tokens:

- ``logp``: current policy, being optimised (carries the gradient).
- ``old_logp``: the trainer's recomputation under the policy that generated the batch (behaviour
  policy of the PPO ratio ``r_t = exp(logp - old_logp)``); treated as a constant (detached).
- ``rollout_logp``: as reported by the inference engine (vLLM/SGLang) at generation time. It differs
  from ``old_logp`` through kernels/precision; ``rlmega.algos.rollout_correction`` corrects for it.

Sign convention: every loss is to be *minimised*; a positive advantage lowers the loss when ``logp``
rises. Advantages are constants (detached).

Each loss is a frozen config dataclass of its options; ``config.build()`` returns the loss
``(logp, old_logp, advantages, response_mask, context) -> (loss, metrics)``. The loss is a 0-dim
tensor aggregated by ``rlmega.algos.aggregation.aggregate_loss`` (see that module for the
micro-batch/DP contract), the metrics a dict of detached 0-dim tensors computed over this call's valid
tokens (for logging; average them over micro-batches as you like):

- ``ppo_kl``: mean of ``old_logp - logp`` (k1 estimate of KL(old || current)).
- ``pg_clipfrac``: fraction of tokens whose ratio was clipped (``_high`` / ``_low``: by which bound).
- ``pg_clipfrac_lower``: dual-clip only, fraction of tokens where the ``clip_ratio_c`` bound is active.

``ppo_policy_loss`` and the other ``*_policy_loss`` functions are the same losses with the config's
fields and the context's as keywords (``policy_loss_base.keyword_function``).

Every loss that exponentiates a log-ratio clamps it first to ``[-log_ratio_clamp, log_ratio_clamp]``
(default 20, GSPO 10; ``None`` disables): a clamped token has a pinned value and no gradient.

All log-ratio arithmetic happens after masking, so padding (even inf/nan) never reaches the loss,
the metrics or the gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from rlmega.algos._policy_common import (
    Metrics,
    check_clip_ratios,
    clamp_log_ratio,
    clip_metrics,
    clipped_surrogate,
    token_ratio_surrogate,
)
from rlmega.algos._utils import check_response_mask, check_same_shape, masked_mean, zero_masked
from rlmega.algos.aggregation import LossDenominators, aggregate_loss
from rlmega.algos.policy_loss_base import BaseLossConfig, RatioLossConfig, keyword_function
from rlmega.algos.policy_loss_cov import ClipCovLossConfig, KLCovLossConfig
from rlmega.algos.policy_loss_extra import GeoMeanLossConfig, ReinforceLossConfig, SAPOLossConfig

# GSPO's sequence log-ratio is clamped at 10, as in verl.
GSPO_LOG_RATIO_CLAMP = 10.0


@dataclasses.dataclass(frozen=True)
class PPOLossConfig(RatioLossConfig):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), optionally asymmetric and dual-clipped.

    With ``r_t = exp(logp_t - old_logp_t)`` and advantage ``A_t``:

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    ``clip_ratio_high`` defaults to ``clip_ratio_low`` (symmetric PPO); a larger value is DAPO's
    clip-higher (Yu et al. 2025, arXiv:2503.14476). With ``clip_ratio_c`` (dual clip, Ye et al.
    2020, arXiv:1912.09729), tokens with ``A_t < 0`` are additionally bounded:
    ``L_t = min(L_t, -A_t * clip_ratio_c)``, so a huge ratio cannot produce an unbounded loss.
    The rollout IS weights of the context are detached and multiply ``L_t``.

    Metrics: ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low`` and, with dual
    clip, ``pg_clipfrac_lower``.
    """

    clip_ratio_low: float = 0.2
    """Lower clip range: ratios below ``1 - clip_ratio_low`` are clipped."""
    clip_ratio_high: Optional[float] = None
    """Upper clip range; None: the same as ``clip_ratio_low`` (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound for negative advantages (> 1); None: no dual clip."""

    def check(self) -> None:
        check_clip_ratios(self.clip_ratio_low, self.upper_clip_ratio)
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")

    @property
    def upper_clip_ratio(self) -> float:
        return self.clip_ratio_low if self.clip_ratio_high is None else self.clip_ratio_high

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio, advantages, per_token_loss, clipped_high, clipped_low = token_ratio_surrogate(
            logp, old_logp, advantages, mask, self.clip_ratio_low, self.upper_clip_ratio, self.log_ratio_clamp)
        metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
        if self.clip_ratio_c is not None:
            dual_bound = -advantages * self.clip_ratio_c
            dual_clipped = (advantages < 0) & (per_token_loss > dual_bound)
            per_token_loss = torch.where(dual_clipped, dual_bound, per_token_loss)
            metrics["pg_clipfrac_lower"] = masked_mean(dual_clipped.to(logp.dtype), mask)
        return self.reduce(per_token_loss, mask, context), metrics


@dataclasses.dataclass(frozen=True)
class ClipHigherLossConfig(PPOLossConfig):
    """DAPO clip-higher (Yu et al. 2025, arXiv:2503.14476): PPO with the paper's decoupled defaults
    ``eps_low = 0.2``, ``eps_high = 0.28``."""

    clip_ratio_high: Optional[float] = 0.28


@dataclasses.dataclass(frozen=True)
class DualClipLossConfig(PPOLossConfig):
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): PPO with ``clip_ratio_c = 3`` by default (verl's)."""

    clip_ratio_c: Optional[float] = 3.0


@dataclasses.dataclass(frozen=True)
class GSPOLossConfig(RatioLossConfig):
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), GSPO-token form.

    Sequence ratio (geometric mean of the token ratios over the ``n_i`` valid tokens):

        s_i = exp( (1/n_i) sum_t (logp_it - old_logp_it) )

    Token-level form with the paper's stop-gradient (``sg``) trick:

        s_it = sg(s_i) * exp(logp_it - sg(logp_it))         (value s_i, d s_it = s_i d logp_it)
        L_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    With ``seq-mean-token-mean`` aggregation (the default, as in the paper) and a per-sequence
    advantage, the gradient is exactly GSPO's ``s_i A_i (1/n_i) sum_t grad logp_it``. The paper
    uses the small clip range 3e-4 / 4e-4 (the defaults). ``log s_it`` is clamped to
    ``[-log_ratio_clamp, log_ratio_clamp]`` (default 10; verl clamps it from above at 10).

    Metrics ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low`` are token-weighted
    fractions.
    """

    loss_agg_mode: str = "seq-mean-token-mean"
    log_ratio_clamp: Optional[float] = GSPO_LOG_RATIO_CLAMP
    clip_ratio_low: float = 3e-4
    """Lower clip range of the sequence ratio."""
    clip_ratio_high: float = 4e-4
    """Upper clip range of the sequence ratio."""

    def check(self) -> None:
        check_clip_ratios(self.clip_ratio_low, self.clip_ratio_high)

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio = zero_masked(logp - old_logp.detach(), mask)
        sequence_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        valid_logp = zero_masked(logp, mask)
        token_log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + (valid_logp - valid_logp.detach())
        ratio = torch.exp(clamp_log_ratio(token_log_ratio, self.log_ratio_clamp))
        advantages = zero_masked(advantages.detach(), mask)
        per_token_loss, clipped_high, clipped_low = clipped_surrogate(
            ratio, advantages, self.clip_ratio_low, self.clip_ratio_high
        )
        metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
        return self.reduce(per_token_loss, mask, context), metrics


@dataclasses.dataclass(frozen=True)
class CISPOLossConfig(RatioLossConfig):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, MiniMax 2025, arXiv:2506.13585).

    The IS weight is clipped and detached, and multiplies a REINFORCE term, so every token keeps a
    gradient (PPO drops clipped tokens entirely):

        w_t = sg(clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),   r_t = exp(logp_t - old_logp_t)
        L_t = -w_t A_t exp(logp_t - sg(logp_t))

    ``exp(logp - sg(logp))`` is 1 in value with gradient ``grad logp``, so ``grad L_t`` is the paper's
    ``-w_t A_t grad logp_t`` while the loss value is ``-w_t A_t``, directly comparable to PPO's.
    The paper does not publish its upper bound; 0.28 (DAPO's eps_high) is our choice of default.

    Metrics ``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low`` count tokens whose
    weight was clipped.
    """

    clip_ratio_low: Optional[float] = None
    """Lower bound of the weight; None: no lower bound (the paper only tunes the upper one)."""
    clip_ratio_high: float = 0.28
    """Upper bound of the weight: ``1 + clip_ratio_high``."""

    def check(self) -> None:
        check_clip_ratios(self.clip_ratio_low, self.clip_ratio_high)

    def compute(self, logp, old_logp, advantages, mask, context):
        log_ratio = zero_masked(logp - old_logp.detach(), mask)
        ratio = torch.exp(clamp_log_ratio(log_ratio, self.log_ratio_clamp)).detach()
        lower_bound = None if self.clip_ratio_low is None else 1.0 - self.clip_ratio_low
        weights = ratio.clamp(min=lower_bound, max=1.0 + self.clip_ratio_high)
        valid_logp = zero_masked(logp, mask)
        per_token_loss = -zero_masked(advantages.detach(), mask) * weights * torch.exp(valid_logp - valid_logp.detach())

        clipped_high = ratio > 1.0 + self.clip_ratio_high
        clipped_low = ratio < lower_bound if lower_bound is not None else torch.zeros_like(mask)
        metrics = clip_metrics(log_ratio, clipped_high, clipped_low, mask)
        return self.reduce(per_token_loss, mask, context), metrics


ppo_policy_loss = keyword_function(PPOLossConfig)
clip_higher_policy_loss = keyword_function(ClipHigherLossConfig)
dual_clip_policy_loss = keyword_function(DualClipLossConfig)
gspo_policy_loss = keyword_function(GSPOLossConfig)
cispo_policy_loss = keyword_function(CISPOLossConfig)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: ``H = -sum_v p_v log p_v``, ``p = softmax(z)``.

    Shapes: logits ``[B, T, V]`` -> ``[B, T]``. Differentiable. ``-inf`` logits (masked or padded
    vocabulary entries) have ``p_v = 0`` and contribute 0.
    """
    log_probabilities = torch.log_softmax(logits, dim=-1)
    probabilities = log_probabilities.exp()
    # Select before multiplying: 0 * -inf would be nan, in the value and in the gradient.
    finite_log_probabilities = torch.where(probabilities > 0, log_probabilities, torch.zeros_like(log_probabilities))
    return -(probabilities * finite_log_probabilities).sum(dim=-1)


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    loss_agg_mode: str = "token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Entropy bonus as a loss term to add to the policy loss: ``-coef * aggregate(H)``.

    Minimising it raises the entropy (Williams & Peng 1991; Mnih et al. 2016). Aggregated like the
    policy loss, so the same micro-batch/DP contract holds.

    Args:
        entropy: ``[B, T]`` per-token entropy (e.g. ``entropy_from_logits``). response_mask: ``[B, T]``.
        coef: bonus coefficient (0 disables it, as verl's default ``entropy_coeff=0``).

    Returns:
        ``(loss, metrics)`` with metric ``entropy``, the mean over this call's valid tokens.
    """
    check_same_shape(entropy=entropy, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    aggregated = aggregate_loss(
        entropy, mask, loss_agg_mode, global_denominators=global_denominators, norm_horizon=norm_horizon
    )
    return -coef * aggregated, {"entropy": masked_mean(entropy, mask).detach()}


# Name -> the loss's config class; ``vanilla`` is textbook PPO (verl's dual-clips: use ``dual_clip``).
POLICY_LOSS_CONFIGS: dict[str, type[BaseLossConfig]] = {
    "ppo": PPOLossConfig,
    "vanilla": PPOLossConfig,
    "clip_higher": ClipHigherLossConfig,
    "dual_clip": DualClipLossConfig,
    "gspo": GSPOLossConfig,
    "cispo": CISPOLossConfig,
    "gpg": ReinforceLossConfig,
    "reinforce": ReinforceLossConfig,
    "sapo": SAPOLossConfig,
    "geo_mean": GeoMeanLossConfig,
    "clip_cov": ClipCovLossConfig,
    "kl_cov": KLCovLossConfig,
}

# Name -> the loss as one function with keywords (``keyword_function``), for direct use on tensors.
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, Metrics]]] = {
    name: keyword_function(config_class) for name, config_class in POLICY_LOSS_CONFIGS.items()
}

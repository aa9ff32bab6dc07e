"""KL divergence to the reference policy: per-token estimators, KL loss, KL-in-reward and its controllers.

Estimators of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With ``d = ref_logp - logp`` (log of
``pi_ref / pi``), each maps ``logp, ref_logp [B, T]`` to ``[B, T]``:

- ``k1`` / ``kl``:          ``-d = logp - ref_logp``           unbiased, can be negative
- ``abs``:                  ``|logp - ref_logp|``
- ``k2`` / ``mse``:         ``0.5 * d^2``                       biased, >= 0, low variance
- ``k3`` / ``low_var_kl``:  ``exp(d) - d - 1``, clamped to [-10, 10] as verl does; unbiased, >= 0
- ``full``:                 exact ``sum_v p_v (log p_v - log q_v)`` from full-vocabulary log-probs
                            ``[B, T, V]`` -> ``[B, T]``

Two ways to use them: as a loss term (``kl_loss``, GRPO-style, default ``low_var_kl``) or inside
the reward (``apply_kl_penalty``, InstructGPT/PPO-style, default ``k1``) with a fixed or adaptive
coefficient (``FixedKLController`` / ``AdaptiveKLController``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlmega.algos._utils import check_response_mask, check_sequence_values, lookup, masked_mean, zero_masked
from rlmega.algos.advantages import place_scores_at_last_token
from rlmega.algos.aggregation import LossDenominators, aggregate_loss

# exp(20) ~ 4.9e8 is finite in float32 and bfloat16: exp never overflows, so a clamped
# (zero-gradient) entry cannot turn into 0 * inf = nan in the backward pass.
_LOG_RATIO_LIMIT = 20.0
_LOW_VAR_KL_LIMIT = 10.0


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1: ``logp - ref_logp`` per token, ``[B, T]``."""
    return logp - ref_logp


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``|logp - ref_logp|`` per token, ``[B, T]``."""
    return (logp - ref_logp).abs()


def kl_mse(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2: ``0.5 * (logp - ref_logp)^2`` per token, ``[B, T]``."""
    return 0.5 * (logp - ref_logp).square()


def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3: ``exp(d) - d - 1`` with ``d = ref_logp - logp``, clamped to [-10, 10]; ``[B, T]``.

    Non-negative (``e^d >= 1 + d``) and unbiased for KL(pi || pi_ref) under samples from pi. The
    output clamp follows verl; ``d`` is also clamped to +-20 so ``exp`` stays finite.
    """
    log_ratio = (ref_logp - logp).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)


def kl_full(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Exact per-token KL from full-vocabulary log-probs: ``sum_v p_v (logp_v - ref_logp_v)``.

    Shapes: ``logp, ref_logp [B, T, V]`` (log-softmax outputs) -> ``[B, T]``. Entries with
    ``p_v = 0`` (e.g. ``-inf`` vocabulary padding) contribute 0 and no nan gradient.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"full KL needs logp and ref_logp of equal shape [B, T, V], got "
            f"logp {list(logp.shape)}, ref_logp {list(ref_logp.shape)}"
        )
    probabilities = torch.exp(logp)
    # Select before multiplying: p * (logp - ref) is 0 * -inf = nan where p_v = 0.
    log_ratio = torch.where(probabilities > 0, logp - ref_logp, torch.zeros_like(logp))
    return (probabilities * log_ratio).sum(dim=-1)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "abs": kl_abs,
    "k2": kl_mse,
    "mse": kl_mse,
    "k3": kl_low_var,
    "low_var_kl": kl_low_var,
    "full": kl_full,
}


def _masked_token_kl(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL ``[B, T]`` (0 on masked tokens) and the bool mask.

    Inputs are zeroed at masked positions *before* the estimator, so padding values cannot produce
    inf/nan there (whose gradient would be nan even after masking the output).
    """
    estimate = lookup(KL_ESTIMATORS, estimator, "KL estimator")
    mask = check_response_mask(response_mask)
    if logp.shape != ref_logp.shape or logp.shape[:2] != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {list(logp.shape)} and ref_logp {list(ref_logp.shape)} must be equal "
            f"and start with response_mask {list(mask.shape)}"
        )
    input_mask = mask.reshape(mask.shape + (1,) * (logp.dim() - 2))
    token_kl = estimate(zero_masked(logp, input_mask), zero_masked(ref_logp, input_mask))
    if token_kl.shape != mask.shape:
        raise ValueError(
            f"KL estimator {estimator!r} returned shape {list(token_kl.shape)} for response_mask "
            f"{list(mask.shape)}; 'full' expects [B, T, V] inputs, the others [B, T]"
        )
    return zero_masked(token_kl, mask), mask


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float = 0.001,
    estimator: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty as a loss term: ``coef * aggregate(kl_t)`` (GRPO, Shao et al. 2024, arXiv:2402.03300).

    Args:
        logp: ``[B, T]`` current-policy log-probs (``[B, T, V]`` for ``full``), differentiable.
        ref_logp: same shape, reference policy. response_mask: ``[B, T]``.
        coef: KL coefficient (verl's default ``kl_loss_coef`` is 0.001; DeepSeekMath used 0.04).
        estimator: a key of ``KL_ESTIMATORS``.
        loss_agg_mode, global_denominators, norm_horizon: passed to ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``; metric ``kl_loss`` is the mean per-token KL over this call's valid
        tokens (before ``coef``).
    """
    token_kl, mask = _masked_token_kl(logp, ref_logp, response_mask, estimator)
    aggregated = aggregate_loss(
        token_kl, mask, loss_agg_mode, global_denominators=global_denominators, norm_horizon=norm_horizon
    )
    return coef * aggregated, {"kl_loss": masked_mean(token_kl, mask).detach()}


@torch.no_grad()
def apply_kl_penalty(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022).

        r_t = s * [t is the last valid token] - kl_coef * kl_t        on valid tokens, 0 elsewhere

    Args:
        scores: ``[B]`` outcome scores. logp, ref_logp: ``[B, T]`` (``[B, T, V]`` for ``full``),
            log-probs of the sampled tokens under the behaviour and reference policies.
        response_mask: ``[B, T]``. kl_coef: beta, e.g. ``controller.value``.
        estimator: a key of ``KL_ESTIMATORS`` (``k1`` is the classic choice).

    Returns:
        ``(token_level_rewards [B, T], metrics)`` with metrics ``kl_token_mean`` (mean per-token KL),
        ``kl_seq_sum_mean`` (per-sequence KL summed over tokens, averaged over non-empty sequences:
        the quantity Ziegler et al.'s target KL refers to) and ``kl_coef``.
    """
    token_kl, mask = _masked_token_kl(logp, ref_logp, response_mask, estimator)
    check_sequence_values("scores", scores, mask)
    rewards = place_scores_at_last_token(scores, mask).to(token_kl.dtype) - kl_coef * token_kl
    non_empty = mask.any(dim=-1)
    metrics = {
        "kl_token_mean": masked_mean(token_kl, mask),
        "kl_seq_sum_mean": masked_mean(token_kl.sum(dim=-1), non_empty),
        "kl_coef": torch.tensor(kl_coef, dtype=token_kl.dtype, device=token_kl.device),
    }
    return rewards, metrics


class FixedKLController:
    """Constant KL coefficient; ``update`` exists so trainers can drive either controller alike."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593, section 2.2).

        e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    ``n_steps`` is the number of samples (episodes) since the last update; ``current_kl`` should
    be on the same scale as ``target_kl`` (the paper uses per-sample KL, i.e. summed over tokens:
    ``kl_seq_sum_mean`` of ``apply_kl_penalty``; verl feeds the per-token mean).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got target_kl={target_kl}, horizon={horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the value that keeps ``current_kl`` at ``target_kl``."""
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

"""Rollout correction: importance weights, rejection and diagnostics for the train-inference mismatch.

The inference engine samples the tokens and reports their log-probs ``rollout_logp [B, T]``; the
trainer recomputes ``old_logp [B, T]`` for the same tokens with the same weights. The two differ
through kernels and precision (and, in asynchronous RL, through staleness), so the batch is
off-policy for the objective the trainer defines under ``old_logp``. With the per-token log-ratio
``l_t = old_logp_t - rollout_logp_t`` and the ratio ``rho_t = exp(l_t)``:

- **Truncated importance sampling** (``rollout_is``): per-token weights ``min(rho_t, C)`` or one
  per-sequence weight ``min(prod_t rho_t, C)`` on every token of the row, passed to a policy loss as
  ``rollout_is_weights`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"; Ionides 2008 for truncated IS).
- **Rejection sampling / masked IS** (``rollout_rs``): tokens, or whole sequences, whose ratio leaves
  ``[lower, upper]`` are removed from the response mask, and so from the loss and its denominators
  (Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
  Training-Inference Mismatch"). Two generations of names: verl up to 0.7.0 bands the ratio
  ``rho = pi_train / pi_rollout`` (``token``, ``sequence``, ``geometric``); verl after 0.7.0 bands its
  k1 statistic ``log(pi_rollout / pi_train) = -l`` (``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``), so the
  same ``[lower, upper]`` keeps ``rho`` in ``[1 / upper, 1 / lower]``: the band is mirrored.
- **Token veto** (``rollout_token_veto_threshold``): a sequence is removed if any of its tokens has
  ``rho_t`` below the threshold, i.e. a token the trainer finds far less likely than the engine did.

The option names, modes and metric names follow verl's rollout correction (``algorithm.rollout_correction``),
so recipes and dashboards carry over; a metric under verl's name is computed as verl computes it.

In bypass mode (``bypass_mode``) the trainer skips its recomputation, ``old_logp`` is the engine's
``rollout_logp``, and the correction runs inside the loss on every micro-batch, comparing the policy
being trained with the engine's (``correct_against_current_policy``), as verl's bypass mode does.

Log-ratios are formed after masking, so padding (even inf/nan) never reaches an output. They are
clamped to +-20 before ``exp`` so weights and metrics stay finite (``e^20 ~ 4.9e8``); threshold tests
compare the unclamped log-ratio with ``log(threshold)``, which is exact at any threshold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from rlmega.algos._utils import check_response_mask, check_same_shape, masked_mean, zero_masked

Metrics = dict[str, torch.Tensor]

ROLLOUT_IS_MODES = ("token", "sequence")
ROLLOUT_RS_RATIO_MODES = ("token", "sequence", "geometric")
"""verl up to 0.7.0: the band bounds ``rho = pi_train / pi_rollout`` (per token, per sequence, geometric mean)."""
ROLLOUT_RS_K1_MODES = ("token_k1", "seq_sum_k1", "seq_mean_k1")
"""verl after 0.7.0: the band bounds ``exp(k1)``, ``k1 = log(pi_rollout / pi_train) = -l`` (per token, summed
over the sequence, averaged over it), so the same band keeps ``rho`` in ``[1 / upper, 1 / lower]``."""
ROLLOUT_RS_MODES = ROLLOUT_RS_RATIO_MODES + ROLLOUT_RS_K1_MODES
_RS_AGGREGATION = {"token": "token", "sequence": "sum", "geometric": "mean",
                   "token_k1": "token", "seq_sum_k1": "sum", "seq_mean_k1": "mean"}
LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` (as verl)."""
RATIO_PERCENTILES = (5, 50, 95)


def _choices(modes: tuple[str, ...]) -> str:
    return ", ".join(["None", *(repr(mode) for mode in modes)])


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """Rollout-vs-trainer correction; field names and defaults as verl's ``RolloutCorrectionConfig``.

    With ``rollout_is``, ``rollout_rs`` and ``rollout_token_veto_threshold`` all unset (the default)
    the correction is off: the mismatch metrics are still computed, nothing is reweighted or masked
    (verl's ``RolloutCorrectionConfig.disabled()``). verl's dataclass defaults ``rollout_is`` to
    ``"sequence"``, but its shipped YAML and its trainer (which leaves the section unset) default to
    off, as here.
    """

    rollout_is: Optional[str] = None
    """Truncated IS weights. None: no weights. ``token``: ``w_t = min(exp(l_t), C)`` (biased, low
    variance). ``sequence``: ``w_i = min(exp(sum_t l_t), C)`` on every token of row i (unbiased before
    truncation, high variance)."""
    rollout_is_threshold: float = 2.0
    """C, the truncation level of the IS weights (> 0). verl suggests 1.5-5 for ``token``, 2-10 for
    ``sequence``."""
    rollout_rs: Optional[str] = None
    """Rejection sampling. None: off. On the ratio ``rho`` (verl up to 0.7.0): ``token`` drops each token
    whose ``exp(l_t)`` is outside ``[lower, upper]``; ``sequence`` drops rows whose ``exp(sum_t l_t)`` is
    outside; ``geometric`` drops rows whose geometric-mean ratio ``exp(mean_t l_t)`` is outside
    (length-normalised, so it needs a tight band such as 1.001). On verl's k1 statistic (verl after 0.7.0),
    the same three with the band on ``exp(-l)``, i.e. mirrored: ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``
    (an asymmetric band such as lower 0.5, upper 1.2 keeps ``rho`` in ``[1/1.2, 2]``)."""
    rollout_rs_threshold: Optional[float] = None
    """Upper bound of the rejection band (> 0); required when ``rollout_rs`` is set, as in verl."""
    rollout_rs_threshold_lower: Optional[float] = None
    """Lower bound of the rejection band (>= 0, below the upper bound; 0: no lower bound). None:
    ``1 / rollout_rs_threshold``, as verl. verl after 0.7.0 writes both bounds in ``rollout_rs_threshold``
    as ``"lower_upper"``; ``--from-verl`` splits it into the two fields."""
    rollout_token_veto_threshold: Optional[float] = None
    """Veto, in (0, 1): a sequence is dropped if any valid token has ``exp(l_t)`` below it. Applied
    independently of ``rollout_is`` and ``rollout_rs``; verl up to 0.7.0 suggests 1e-4 to 1e-6 (later verl
    has no veto). None: off."""
    bypass_mode: bool = False
    """Read by the trainer: skip the trainer's recomputation and use ``rollout_logp`` as ``old_logp``
    (two policies instead of three; PPO then clips against the engine's policy). The IS weights and the
    rejection are then computed inside the loss, per micro-batch, from the current policy's log-probs
    against the engine's (``correct_against_current_policy``), as in verl: the rejection applies to every
    loss, the IS weights only to a loss without a ratio (``reinforce``, ``gpg``: verl's
    ``loss_type=reinforce``), since a ratio loss's ratio already is ``pi_theta / pi_rollout``."""
    reject_before_advantages: bool = True
    """Where the rejection (and veto) acts. True (verl): the rejected tokens leave the mask the advantages
    are computed on, so GAE skips them (with their rewards: a rejected last token takes the sequence's
    score with it), REINFORCE++'s return restarts at them, whitening and ReMax's reward-to-go leave them out;
    rewards are still placed, and the KL in the reward taken, on the mask before rejection. False: the
    advantages see the mask before rejection and the rejection only narrows the loss. Outcome estimators
    (GRPO, RLOO, ...) give the same advantages either way. Not read in bypass mode, where the rejection
    happens inside the loss."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_is={self.rollout_is!r} is not one of {_choices(ROLLOUT_IS_MODES)}")
        _check_positive("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_rs is not None and self.rollout_rs not in ROLLOUT_RS_MODES:
            raise ValueError(f"rollout_rs={self.rollout_rs!r} is not one of {_choices(ROLLOUT_RS_MODES)}")
        if self.rollout_rs is None:
            for name in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but rollout_rs is None; set rollout_rs or unset {name}")
        else:
            if self.rollout_rs_threshold is None:
                raise ValueError(f"rollout_rs_threshold is required with rollout_rs={self.rollout_rs!r}")
            _check_positive("rollout_rs_threshold", self.rollout_rs_threshold)
            lower, upper = self.rollout_rs_bounds
            if self.rollout_rs_threshold_lower is None and not upper > 1:
                raise ValueError(
                    f"rollout_rs_threshold must be > 1 while rollout_rs_threshold_lower is None (the lower bound "
                    f"is then 1 / rollout_rs_threshold), got {upper!r}; or set rollout_rs_threshold_lower"
                )
            if not 0 <= lower < upper:
                raise ValueError(
                    f"rollout_rs_threshold_lower must be in [0, rollout_rs_threshold) = [0, {upper}), got {lower!r}"
                )
        veto = self.rollout_token_veto_threshold
        if veto is not None and not 0 < veto < 1:
            raise ValueError(f"rollout_token_veto_threshold must be in (0, 1), got {veto!r}")

    @property
    def enabled(self) -> bool:
        """Whether the correction changes anything (weights or mask); metrics are computed regardless."""
        return (
            self.rollout_is is not None or self.rollout_rs is not None or self.rollout_token_veto_threshold is not None
        )

    @property
    def rollout_rs_bounds(self) -> tuple[float, float]:
        """``(lower, upper)`` of the rejection band, with the lower default ``1 / upper`` resolved."""
        if self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs_bounds needs rollout_rs_threshold")
        upper = self.rollout_rs_threshold
        lower = 1.0 / upper if self.rollout_rs_threshold_lower is None else self.rollout_rs_threshold_lower
        return lower, upper


@dataclasses.dataclass
class RolloutCorrection:
    """Result of ``compute_rollout_correction``; every tensor is detached."""

    is_weights: Optional[torch.Tensor]
    """``[B, T]`` truncated IS weights, 0 wherever ``response_mask`` is 0; None without ``rollout_is``."""
    response_mask: torch.Tensor
    """``[B, T]`` the input mask (same dtype) minus the rejected and vetoed tokens; use it for the loss."""
    metrics: Metrics
    """0-dim tensors: ``rollout_mismatch_metrics`` plus the correction's own."""


def _log_bound(threshold: float) -> float:
    """``log(threshold)``, with ``log(0) = -inf`` so that a zero lower bound rejects nothing."""
    return math.log(threshold) if threshold > 0 else -math.inf


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of ``values`` over ``mask``; 0 if the mask is empty."""
    fill = -math.inf if largest else math.inf
    candidates = torch.where(mask, values, fill).flatten()
    padded = torch.cat([candidates, candidates.new_full((1,), fill)])  # defined for zero-size inputs
    extreme = padded.amax() if largest else padded.amin()
    return torch.where(mask.any(), extreme, torch.zeros_like(extreme))


def _masked_percentiles(values: torch.Tensor, mask: torch.Tensor, percentiles: tuple[int, ...]) -> list[torch.Tensor]:
    """Percentiles of ``values`` over ``mask`` with linear interpolation (numpy's and torch.quantile's
    default); 0 if the mask is empty.

    A sort with the invalid entries pushed to +inf, not ``torch.quantile``, which refuses inputs of
    more than 2**24 elements (a single large batch), and no boolean indexing, so no device sync.
    """
    candidates = torch.where(mask, values, math.inf).flatten()
    ordered = torch.cat([candidates, candidates.new_full((1,), math.inf)]).sort().values  # defined for zero size
    num_valid = mask.sum()
    last = (num_valid - 1).clamp(min=0)
    results = []
    for percentile in percentiles:
        position = last.double() * (percentile / 100)  # float64: exact indices beyond 2**24 tokens
        low = position.floor().long()
        high = torch.minimum(low + 1, last)
        fraction = (position - low.double()).to(values.dtype)
        low_value, high_value = ordered.take(low), ordered.take(high)  # take: a tensor index, no sync
        value = low_value + (high_value - low_value) * fraction
        results.append(torch.where(num_valid > 0, value, torch.zeros_like(value)))
    return results


def _verl_rows(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: the rows verl averages per-sequence metrics over, every row of the batch (fully masked
    rows included); none when no token is valid, where verl raises and the metrics here are 0."""
    return mask.any().expand(mask.shape[:1])


def _checked_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp, response_mask=response_mask)
    return check_response_mask(response_mask)


@torch.no_grad()
def rollout_mismatch_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
) -> Metrics:
    """How far the engine's log-probs are from the trainer's, over the valid tokens of this call.

    With ``l_t = old_logp_t - rollout_logp_t`` and ``rho_t = exp(clamp(l_t, +-20))``; per sequence,
    ``mean_t`` runs over its valid tokens. Sequence averages, maxima and minima run over every row of the
    batch, as verl's do: a fully masked row counts as one whose per-sequence values are 0 (so a ppl of 1,
    a ratio of 1). verl's names (its ``rollout_corr/`` metrics and ``training/rollout_probs_diff_*``)
    where verl has the metric, computed as verl computes it; ``mismatch/`` otherwise:

    - ``rollout_corr/kl``: ``mean(-l)``, k1 estimate of KL(rollout || trainer) (can be negative).
    - ``rollout_corr/k3_kl``: ``mean(rho - log rho - 1)``, k3 estimate of the same KL (>= 0).
    - ``rollout_corr/training_ppl``, ``rollout_corr/rollout_ppl``: sequence mean of ``exp(-mean_t logp)``;
      ``..._log_ppl``: sequence mean of ``-mean_t logp``.
    - ``rollout_corr/log_ppl_diff`` (``_abs_diff``, ``_max``, ``_min``): of ``d_i = mean_t l_t`` =
      log(training ppl / rollout ppl) per sequence; ``rollout_corr/ppl_ratio``: sequence mean of ``exp(d_i)``.
    - ``rollout_corr/chi2_token``: ``mean(rho^2) - 1``; ``rollout_corr/chi2_seq``: sequence mean of
      ``exp(2 sum_t l_t) - 1`` (second moments of the token and sequence IS weights).
    - ``training/rollout_probs_diff_mean``, ``_max``: of ``|exp(old_logp) - exp(rollout_logp)|``.
    - ``mismatch/abs_log_prob_diff_mean``, ``_max``: of ``|l_t|``.
    - ``mismatch/ratio_mean``, ``mismatch/ratio_p5``, ``_p50``, ``_p95``: of ``rho_t``.

    Shapes ``[B, T]``; returns detached 0-dim tensors, all 0 when no token is valid.
    """
    mask = _checked_mask(old_logp, rollout_logp, response_mask)
    old = zero_masked(old_logp, mask)
    rollout = zero_masked(rollout_logp, mask)
    log_ratio = old - rollout
    safe_log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(safe_log_ratio)
    abs_log_ratio = log_ratio.abs()
    prob_diff = zero_masked((torch.exp(old) - torch.exp(rollout)).abs(), mask)

    num_tokens = mask.sum(dim=-1)
    rows = _verl_rows(mask)
    training_mean_logp = old.sum(dim=-1) / num_tokens.clamp(min=1)
    rollout_mean_logp = rollout.sum(dim=-1) / num_tokens.clamp(min=1)
    log_ppl_diff = rollout_mean_logp - training_mean_logp
    sequence_log_ratio = log_ratio.sum(dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio_p5, ratio_p50, ratio_p95 = _masked_percentiles(ratio, mask, RATIO_PERCENTILES)

    return {
        "rollout_corr/kl": masked_mean(-log_ratio, mask),
        "rollout_corr/k3_kl": masked_mean(ratio - safe_log_ratio - 1, mask),
        "rollout_corr/training_ppl": masked_mean(torch.exp(-training_mean_logp), rows),
        "rollout_corr/training_log_ppl": masked_mean(-training_mean_logp, rows),
        "rollout_corr/rollout_ppl": masked_mean(torch.exp(-rollout_mean_logp), rows),
        "rollout_corr/rollout_log_ppl": masked_mean(-rollout_mean_logp, rows),
        "rollout_corr/log_ppl_diff": masked_mean(log_ppl_diff, rows),
        "rollout_corr/log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), rows),
        "rollout_corr/log_ppl_diff_max": _masked_extreme(log_ppl_diff, rows, largest=True),
        "rollout_corr/log_ppl_diff_min": _masked_extreme(log_ppl_diff, rows, largest=False),
        "rollout_corr/ppl_ratio": masked_mean(
            torch.exp(log_ppl_diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), rows
        ),
        "rollout_corr/chi2_token": masked_mean(ratio.square() - 1, mask),
        "rollout_corr/chi2_seq": masked_mean(torch.exp(2 * sequence_log_ratio) - 1, rows),
        "training/rollout_probs_diff_mean": masked_mean(prob_diff, mask),
        "training/rollout_probs_diff_max": _masked_extreme(prob_diff, mask, largest=True),
        "mismatch/abs_log_prob_diff_mean": masked_mean(abs_log_ratio, mask),
        "mismatch/abs_log_prob_diff_max": _masked_extreme(abs_log_ratio, mask, largest=True),
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/ratio_p5": ratio_p5,
        "mismatch/ratio_p50": ratio_p50,
        "mismatch/ratio_p95": ratio_p95,
    }


def _importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, Metrics]:
    """Truncated IS weights ``[B, T]`` (0 on masked tokens) and their metrics, over the input mask.

    As verl: ``rollout_is_mean`` is the mean weight *before* truncation (after the +-20 clamp), and for
    ``sequence`` the truncated fraction counts sequences over every row of the batch."""
    if mode == "token":
        unit_log_ratio = log_ratio
        fraction_high = masked_mean((log_ratio > math.log(cap)).to(log_ratio.dtype), mask)
    else:
        unit_log_ratio = log_ratio.sum(dim=-1, keepdim=True)
        above = (unit_log_ratio.squeeze(-1) > math.log(cap)).to(log_ratio.dtype)
        fraction_high = masked_mean(above, _verl_rows(mask))
    unit_weights = torch.exp(unit_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    untruncated = zero_masked(unit_weights.expand(mask.shape), mask)
    return untruncated.clamp(max=cap), {
        "rollout_corr/rollout_is_mean": masked_mean(untruncated, mask),
        "rollout_corr/rollout_is_ratio_fraction_high": fraction_high,
    }


def _rejection_statistic(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The log-space quantity the band bounds: ``[B, T]`` per token, ``[B, 1]`` per sequence.

    Ratio modes use the exact ``l``; k1 modes use ``-clamp(l, +-20)`` per token before summing or
    averaging, as verl's k1 statistics do (the two differ only where a token's ``|l|`` exceeds 20)."""
    if mode in ROLLOUT_RS_K1_MODES:
        log_ratio = zero_masked(-log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), mask)
    aggregation = _RS_AGGREGATION[mode]
    if aggregation == "token":
        return log_ratio
    summed = log_ratio.sum(dim=-1, keepdim=True)
    return summed if aggregation == "sum" else summed / mask.sum(dim=-1, keepdim=True).clamp(min=1)


def _rejection_keep(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, lower: float, upper: float
) -> tuple[torch.Tensor, Metrics]:
    """Bool ``[B, T]``: valid tokens whose statistic (``_rejection_statistic``) lies in ``[log lower, log upper]``."""
    statistic = _rejection_statistic(log_ratio, mask, mode)
    in_band = (statistic >= _log_bound(lower)) & (statistic <= math.log(upper))
    keep = in_band.expand(mask.shape) & mask
    rejected = mask & ~keep
    return keep, {
        "rollout_corr/rollout_rs_masked_fraction": masked_mean(rejected.to(log_ratio.dtype), mask),
        "rollout_corr/rollout_rs_seq_masked_fraction": masked_mean(
            rejected.any(dim=-1).to(log_ratio.dtype), _verl_rows(mask)
        ),
    }


def _veto_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, Metrics]:
    """Bool ``[B, 1]``: rows without a valid token whose ratio is below ``threshold``."""
    catastrophic = (log_ratio < math.log(threshold)) & mask
    vetoed = catastrophic.any(dim=-1, keepdim=True)
    return ~vetoed, {
        "rollout_corr/rollout_is_veto_fraction": masked_mean(
            vetoed.squeeze(-1).to(log_ratio.dtype), _verl_rows(mask)
        ),
        "rollout_corr/rollout_is_catastrophic_token_fraction": masked_mean(catastrophic.to(log_ratio.dtype), mask),
    }


@torch.no_grad()
def compute_rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """IS weights and the rejection-filtered response mask for one batch (see the module docstring).

    Steps, all on ``l_t = old_logp_t - rollout_logp_t`` over the valid tokens of ``response_mask``:
    truncated IS weights (``config.rollout_is``), the rejection band (``config.rollout_rs``), the
    token veto (``config.rollout_token_veto_threshold``). Rejection and veto only shrink the mask;
    the weights are computed before them and zeroed wherever the returned mask is 0. Feed
    ``result.response_mask`` and ``result.is_weights`` (as ``rollout_is_weights=``) to a policy loss;
    the removed tokens leave the loss and its denominators, so count ``LossDenominators`` on the
    returned mask.

    Args:
        old_logp, rollout_logp: ``[B, T]`` log-probs of the sampled tokens (detached here).
        response_mask: ``[B, T]`` bool or 0/1; padding in the log-probs may hold inf/nan.
        config: the ``RolloutCorrectionConfig``.

    Returns:
        ``RolloutCorrection(is_weights, response_mask, metrics)``. Metrics: all of
        ``rollout_mismatch_metrics``; ``mismatch/masked_token_fraction`` and
        ``mismatch/masked_seq_fraction`` (valid tokens, and sequences with a valid token, that
        rejection and veto removed together; always present); with ``rollout_is``,
        ``rollout_corr/rollout_is_mean`` (mean weight over the input's valid tokens *before*
        truncation, as verl) and ``rollout_corr/rollout_is_ratio_fraction_high`` (fraction of tokens,
        or for ``sequence`` of sequences, whose weight was truncated); with ``rollout_rs``,
        ``rollout_corr/rollout_rs_masked_fraction`` and ``rollout_corr/rollout_rs_seq_masked_fraction``
        (removed by rejection alone); with the veto, ``rollout_corr/rollout_is_veto_fraction``
        (sequences) and ``rollout_corr/rollout_is_catastrophic_token_fraction`` (tokens). Fractions of
        sequences under verl's names count every row of the batch, fully masked ones included (verl's
        denominators); ``mismatch/masked_seq_fraction`` counts the rows with a valid token.
    """
    metrics = rollout_mismatch_metrics(old_logp, rollout_logp, response_mask)
    mask = _checked_mask(old_logp, rollout_logp, response_mask)
    has_tokens = mask.any(dim=-1)
    log_ratio = zero_masked(old_logp - rollout_logp, mask)

    is_weights = None
    if config.rollout_is is not None:
        is_weights, is_metrics = _importance_weights(log_ratio, mask, config.rollout_is, config.rollout_is_threshold)
        metrics.update(is_metrics)
    keep = mask
    if config.rollout_rs is not None:
        rs_keep, rs_metrics = _rejection_keep(log_ratio, mask, config.rollout_rs, *config.rollout_rs_bounds)
        keep = keep & rs_keep
        metrics.update(rs_metrics)
    if config.rollout_token_veto_threshold is not None:
        veto_keep, veto_metrics = _veto_keep(log_ratio, mask, config.rollout_token_veto_threshold)
        keep = keep & veto_keep
        metrics.update(veto_metrics)

    removed = mask & ~keep
    metrics["mismatch/masked_token_fraction"] = masked_mean(removed.to(log_ratio.dtype), mask)
    metrics["mismatch/masked_seq_fraction"] = masked_mean(removed.any(dim=-1).to(log_ratio.dtype), has_tokens)
    if is_weights is not None:
        is_weights = zero_masked(is_weights, keep)
    return RolloutCorrection(is_weights=is_weights, response_mask=keep.to(response_mask.dtype), metrics=metrics)


@torch.no_grad()
def correct_against_current_policy(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    weights_apply: bool,
) -> RolloutCorrection:
    """Bypass mode's correction, inside the loss: the current policy ``logp`` against the engine's.

    In bypass mode ``old_logp`` is ``rollout_logp``, so the correction the trainer computes up front
    would compare the engine with itself. verl's bypass mode instead corrects, on every micro-batch,
    the policy being trained (``pi_theta``, detached) against the engine's: this is
    ``compute_rollout_correction(logp, rollout_logp, ...)``. The rejected tokens leave the loss (the
    loss's denominators, counted on the mini-batch before, keep them, as verl's do). ``weights_apply``:
    whether the loss takes the IS weights; verl applies them only to its REINFORCE loss, as a ratio
    loss's ratio ``pi_theta / pi_rollout`` already is the IS ratio (the weights would count it twice);
    otherwise ``is_weights`` is None and only the metrics report them.

    Shapes ``[B, T]``; returns ``RolloutCorrection`` as ``compute_rollout_correction`` does.
    """
    correction = compute_rollout_correction(logp.detach(), rollout_logp, response_mask, config)
    if not weights_apply:
        correction = dataclasses.replace(correction, is_weights=None)
    return correction


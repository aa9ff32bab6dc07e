"""RL algorithm core of rlmega: advantage estimators, policy losses, KL, loss aggregation, DAPO pieces.

Pure torch functions with no dependency on the rest of rlmega. Conventions (shapes, log-prob
names, signs, the micro-batch/DP aggregation contract, defaults) are in ``README.md`` next to
this file.
"""

from rlmega.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_dr_grpo_outcome_advantages,
    compute_gae_advantages,
    compute_gpg_outcome_advantages,
    compute_grpo_outcome_advantages,
    compute_grpo_passk_outcome_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_outcome_advantages,
    compute_rloo_outcome_advantages,
    masked_whiten,
    place_scores_at_last_token,
)
from rlmega.algos.aggregation import LOSS_AGG_MODES, LossDenominators, aggregate_loss, count_loss_denominators
from rlmega.algos.dapo import (
    DynamicSamplingResult,
    dynamic_sampling_filter,
    overlong_filter_mask,
    overlong_reward_penalty,
)
from rlmega.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_abs,
    kl_full,
    kl_k1,
    kl_loss,
    kl_low_var,
    kl_mse,
)
from rlmega.algos.policy_loss import (
    POLICY_LOSSES,
    cispo_policy_loss,
    clip_higher_policy_loss,
    dual_clip_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
)
from rlmega.algos.policy_loss_cov import clip_cov_policy_loss, kl_cov_policy_loss
from rlmega.algos.policy_loss_extra import geo_mean_policy_loss, reinforce_policy_loss, sapo_policy_loss
from rlmega.algos.rollout_correction import (
    RolloutCorrection,
    RolloutCorrectionConfig,
    compute_rollout_correction,
    rollout_mismatch_metrics,
)
from rlmega.algos.value_loss import clipped_value_loss
from rlmega.algos.registry import get_advantage_estimator, get_kl_estimator, get_loss_agg_mode, get_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "AdaptiveKLController",
    "DynamicSamplingResult",
    "FixedKLController",
    "LossDenominators",
    "aggregate_loss",
    "apply_kl_penalty",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "clip_higher_policy_loss",
    "clipped_value_loss",
    "compute_dr_grpo_outcome_advantages",
    "compute_gae_advantages",
    "compute_gpg_outcome_advantages",
    "compute_grpo_outcome_advantages",
    "compute_grpo_passk_outcome_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_outcome_advantages",
    "compute_rollout_correction",
    "compute_rloo_outcome_advantages",
    "count_loss_denominators",
    "dual_clip_policy_loss",
    "dynamic_sampling_filter",
    "entropy_bonus",
    "entropy_from_logits",
    "geo_mean_policy_loss",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_agg_mode",
    "get_policy_loss",
    "gspo_policy_loss",
    "kl_abs",
    "kl_cov_policy_loss",
    "kl_full",
    "kl_k1",
    "kl_loss",
    "kl_low_var",
    "kl_mse",
    "masked_whiten",
    "overlong_filter_mask",
    "overlong_reward_penalty",
    "place_scores_at_last_token",
    "ppo_policy_loss",
    "rollout_mismatch_metrics",
    "reinforce_policy_loss",
    "sapo_policy_loss",
]

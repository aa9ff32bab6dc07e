"""Name lookups: known names resolve, unknown names raise ValueError listing the valid ones."""

from __future__ import annotations

import pytest

from rlmega.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    clip_cov_policy_loss,
    compute_gpg_outcome_advantages,
    compute_grpo_passk_outcome_advantages,
    geo_mean_policy_loss,
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
    kl_cov_policy_loss,
    reinforce_policy_loss,
    sapo_policy_loss,
)

LOOKUPS = [
    (get_advantage_estimator, ADVANTAGE_ESTIMATORS, "advantage estimator"),
    (get_policy_loss, POLICY_LOSSES, "policy loss"),
    (get_kl_estimator, KL_ESTIMATORS, "KL estimator"),
    (get_loss_agg_mode, LOSS_AGG_MODES, "loss aggregation mode"),
]


def test_registries_hold_the_expected_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
        "gpg", "grpo_passk",
    }
    assert set(POLICY_LOSSES) == {
        "ppo", "vanilla", "clip_higher", "dual_clip", "gspo", "cispo",
        "gpg", "reinforce", "sapo", "geo_mean", "clip_cov", "kl_cov",
    }
    assert set(KL_ESTIMATORS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "full"}
    assert set(LOSS_AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def test_new_names_resolve_to_their_functions() -> None:
    assert get_advantage_estimator("gpg") is compute_gpg_outcome_advantages
    assert get_advantage_estimator("grpo_passk") is compute_grpo_passk_outcome_advantages
    assert get_policy_loss("gpg") is get_policy_loss("reinforce") is reinforce_policy_loss
    assert get_policy_loss("sapo") is sapo_policy_loss
    assert get_policy_loss("geo_mean") is geo_mean_policy_loss
    assert get_policy_loss("clip_cov") is clip_cov_policy_loss
    assert get_policy_loss("kl_cov") is kl_cov_policy_loss


@pytest.mark.parametrize(("get", "registry", "kind"), LOOKUPS)
def test_known_names_resolve(get, registry, kind) -> None:
    for name, entry in registry.items():
        assert get(name) is entry


@pytest.mark.parametrize(("get", "registry", "kind"), LOOKUPS)
def test_unknown_name_lists_valid_names(get, registry, kind) -> None:
    with pytest.raises(ValueError) as error:
        get("no-such-thing")
    message = str(error.value)
    assert f"unknown {kind} 'no-such-thing'" in message
    assert all(name in message for name in registry)

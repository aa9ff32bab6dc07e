"""Rollout correction: truncated IS weights, rejection, veto and the mismatch metrics, by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

from rlmega.algos.policy_loss import ppo_policy_loss
from rlmega.algos.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction,
    rollout_mismatch_metrics,
)

F64 = torch.float64
NAN = math.nan
INF = math.inf


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _from_log_ratio(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(old_logp, rollout_logp)`` with ``old - rollout`` exactly the given values (rollout = 0);
    padded entries should be given as nan."""
    old_logp = _tensor(rows)
    return old_logp, torch.zeros_like(old_logp)


def _close(value: torch.Tensor, expected: float) -> None:
    assert value.dim() == 0 and not value.requires_grad
    assert value.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


# --------------------------------------------------------------------------------------- IS weights


def test_token_level_truncated_is_weights() -> None:
    old_logp, rollout_logp = _from_log_ratio([[0.5, -0.2, 1.0, NAN]])  # e^1 = 2.72 is truncated at 2
    mask = _tensor([[1, 1, 1, 0]])
    result = compute_rollout_correction(old_logp, rollout_logp, mask, RolloutCorrectionConfig(rollout_is="token"))
    expected = _tensor([[math.exp(0.5), math.exp(-0.2), 2.0, 0.0]])
    torch.testing.assert_close(result.is_weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(result.response_mask, mask, rtol=0, atol=0)
    # verl's mean is taken before truncation (rollout_corr_helper.py, compute_rollout_correction_weights)
    _close(result.metrics["rollout_corr/rollout_is_mean"], (math.exp(0.5) + math.exp(-0.2) + math.e) / 3)
    _close(result.metrics["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3)


def test_sequence_level_truncated_is_weights_broadcast_over_the_row() -> None:
    old_logp, rollout_logp = _from_log_ratio(
        [
            [0.1, 0.2, NAN],  # sum 0.3 -> e^0.3 = 1.35
            [0.5, 0.6, 0.1],  # sum 1.2 -> e^1.2 = 3.32, truncated
            [NAN, NAN, NAN],  # no valid token
        ]
    )
    mask = _tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    config = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    w = math.exp(0.3)
    torch.testing.assert_close(result.is_weights, _tensor([[w, w, 0], [2, 2, 2], [0, 0, 0]]), rtol=0, atol=1e-12)
    _close(result.metrics["rollout_corr/rollout_is_mean"], (2 * w + 3 * math.exp(1.2)) / 5)  # before truncation
    _close(result.metrics["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3)  # of all 3 rows, as verl

    wider = compute_rollout_correction(
        old_logp, rollout_logp, mask, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0)
    )
    w2 = math.exp(1.2)
    torch.testing.assert_close(wider.is_weights, _tensor([[w, w, 0], [w2, w2, w2], [0, 0, 0]]), rtol=0, atol=1e-12)
    _close(wider.metrics["rollout_corr/rollout_is_ratio_fraction_high"], 0.0)


def test_truncation_is_at_exactly_c_and_log_ratios_are_clamped_before_exp() -> None:
    old_logp = _tensor([[0.0, -1.0, -1001.0]])
    rollout_logp = _tensor([[-math.log(3.0), -1001.0, -1.0]])  # log-ratios log 3, 1000, -1000
    mask = _tensor([[1, 1, 1]])
    result = compute_rollout_correction(
        old_logp, rollout_logp, mask, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=3.0)
    )
    # ratio 3 is not truncated (min(3, 3)); e^1000 is clamped to e^20 then truncated; e^-1000 -> e^-20.
    torch.testing.assert_close(result.is_weights, _tensor([[3.0, 3.0, math.exp(-20.0)]]), rtol=1e-12, atol=0)
    _close(result.metrics["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3)
    assert all(torch.isfinite(value) for value in result.metrics.values())


# ---------------------------------------------------------------------------------------- rejection


def test_token_rejection_masks_exactly_the_tokens_outside_the_band() -> None:
    # band [1/2, 2] (lower defaults to 1 / upper); both ends are inside.
    old_logp, rollout_logp = _from_log_ratio(
        [
            [math.log(3.0), 0.0, math.log(0.4), math.log(2.0)],
            [math.log(0.5), math.log(2.5), math.log(1.5), NAN],
        ]
    )
    mask = _tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    config = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    assert result.is_weights is None
    torch.testing.assert_close(result.response_mask, _tensor([[0, 1, 0, 1], [1, 0, 1, 0]]), rtol=0, atol=0)
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], 3 / 7)
    _close(result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)
    _close(result.metrics["mismatch/masked_token_fraction"], 3 / 7)
    _close(result.metrics["mismatch/masked_seq_fraction"], 1.0)


def test_token_rejection_with_an_explicit_lower_bound() -> None:
    old_logp, rollout_logp = _from_log_ratio([[math.log(0.1), math.log(0.9), math.log(1.3), math.log(1e-9)]])
    mask = _tensor([[1, 1, 1, 1]])
    config = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.2, rollout_rs_threshold_lower=0.0)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    torch.testing.assert_close(result.response_mask, _tensor([[1, 1, 0, 1]]), rtol=0, atol=0)  # no lower bound

    config = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.2, rollout_rs_threshold_lower=0.5)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    torch.testing.assert_close(result.response_mask, _tensor([[0, 1, 0, 0]]), rtol=0, atol=0)


def test_sequence_rejection_masks_whole_rows() -> None:
    old_logp, rollout_logp = _from_log_ratio(
        [
            [0.3, 0.3, NAN],  # prod e^0.6 = 1.82: kept
            [0.4, 0.4, NAN],  # e^0.8 = 2.23 > 2: rejected, though each token is in band
            [-0.4, -0.4, NAN],  # e^-0.8 = 0.45 < 0.5: rejected
            [0.5, -0.5, 1.5],  # padding holds a value far out of band; e^0 = 1: kept
        ]
    )
    mask = _tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    config = RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=2.0)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    torch.testing.assert_close(result.response_mask, _tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]]))
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], 4 / 8)
    _close(result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 2 / 4)


def test_geometric_rejection_uses_the_per_token_mean_and_masks_whole_rows() -> None:
    old_logp, rollout_logp = _from_log_ratio(
        [
            [0.05, 0.04, NAN],  # mean 0.045 -> 1.046: kept (and its product e^0.09 = 1.094)
            [0.3, -0.1, 0.0],  # mean 0.0667 -> 1.069: kept (its product e^0.2 = 1.22 is not)
            [0.2, 0.1, NAN],  # mean 0.15 -> 1.16 > 1.1: rejected
            [-0.2, NAN, NAN],  # mean -0.2 -> 0.82 < 1 / 1.1: rejected
        ]
    )
    mask = _tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    geometric = RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.1)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, geometric)
    torch.testing.assert_close(result.response_mask, _tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]))
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], 3 / 8)
    _close(result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 2 / 4)

    sequence = RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=1.1)
    by_product = compute_rollout_correction(old_logp, rollout_logp, mask, sequence)
    torch.testing.assert_close(by_product.response_mask, _tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]))


def test_veto_rejects_a_sequence_with_any_token_below_the_threshold() -> None:
    old_logp, rollout_logp = _from_log_ratio(
        [
            [0.0, -10.0, 0.0],  # e^-10 = 4.5e-5 < 1e-4: the whole row is vetoed
            [0.0, -5.0, -100.0],  # e^-5 is above; the -100 sits in padding
        ]
    )
    mask = _tensor([[1, 1, 1], [1, 1, 0]])
    config = RolloutCorrectionConfig(rollout_is="token", rollout_token_veto_threshold=1e-4)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    torch.testing.assert_close(result.response_mask, _tensor([[0, 0, 0], [1, 1, 0]]), rtol=0, atol=0)
    torch.testing.assert_close(result.is_weights, _tensor([[0, 0, 0], [1, math.exp(-5.0), 0]]), rtol=0, atol=1e-12)
    _close(result.metrics["rollout_corr/rollout_is_veto_fraction"], 1 / 2)
    _close(result.metrics["rollout_corr/rollout_is_catastrophic_token_fraction"], 1 / 5)
    _close(result.metrics["mismatch/masked_seq_fraction"], 1 / 2)
    _close(result.metrics["mismatch/masked_token_fraction"], 3 / 5)
    # IS metrics describe the weights before rejection, over the input's valid tokens.
    _close(result.metrics["rollout_corr/rollout_is_mean"], (1 + math.exp(-10.0) + 1 + 1 + math.exp(-5.0)) / 5)


def test_rejection_and_veto_combine_and_weights_follow_the_returned_mask() -> None:
    old_logp, rollout_logp = _from_log_ratio([[0.0, math.log(3.0), 0.1], [-12.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    config = RolloutCorrectionConfig(
        rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4
    )
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    assert result.response_mask.dtype == torch.bool
    torch.testing.assert_close(result.response_mask, torch.tensor([[True, False, True], [False, False, False]]))
    torch.testing.assert_close(result.is_weights, _tensor([[1.0, 0.0, math.exp(0.1)], [0, 0, 0]]), rtol=0, atol=1e-12)
    # rejection alone removes the ratio-3 token and the e^-12 token; the veto adds the rest of row 1.
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], 2 / 5)
    _close(result.metrics["mismatch/masked_token_fraction"], 3 / 5)
    _close(result.metrics["mismatch/masked_seq_fraction"], 1.0)


# ---------------------------------------------------------------------------------------- padding


def test_inf_and_nan_padding_never_leak() -> None:
    clean_old, clean_rollout = _from_log_ratio([[0.3, -0.2, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    clean_old = clean_old - 1.0
    clean_rollout = clean_rollout - 1.0
    mask = _tensor([[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    padding_old = _tensor([[0, 0, INF, NAN], [NAN, 0, -INF, INF], [NAN, INF, -INF, NAN]])
    padding_rollout = _tensor([[0, 0, -INF, INF], [INF, 0, NAN, -INF], [-INF, NAN, INF, 0]])
    dirty_old = torch.where(mask.bool(), clean_old, padding_old)
    dirty_rollout = torch.where(mask.bool(), clean_rollout, padding_rollout)
    config = RolloutCorrectionConfig(
        rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=1.5, rollout_token_veto_threshold=1e-4
    )
    clean = compute_rollout_correction(clean_old, clean_rollout, mask, config)
    dirty = compute_rollout_correction(dirty_old, dirty_rollout, mask, config)
    torch.testing.assert_close(dirty.is_weights, clean.is_weights, rtol=0, atol=0)
    torch.testing.assert_close(dirty.response_mask, clean.response_mask, rtol=0, atol=0)
    assert dirty.metrics.keys() == clean.metrics.keys()
    for name, value in dirty.metrics.items():
        assert torch.isfinite(value), name
        torch.testing.assert_close(value, clean.metrics[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------- metrics


def test_mismatch_metrics_by_hand() -> None:
    old_logp = _tensor([[-1.0, -2.0], [-0.5, NAN]])
    rollout_logp = _tensor([[-1.5, -1.8], [-0.3, INF]])
    mask = _tensor([[1, 1], [1, 0]])
    metrics = rollout_mismatch_metrics(old_logp, rollout_logp, mask)

    log_ratios = [0.5, -0.2, -0.2]  # old - rollout over the valid tokens
    ratios = sorted(math.exp(value) for value in log_ratios)  # e^-0.2, e^-0.2, e^0.5
    d = [(-1.5 - 1.8) / 2 - (-1.0 - 2.0) / 2, -0.3 - (-0.5)]  # rollout mean logp - trainer mean logp
    probability_diffs = [abs(math.exp(-1.0) - math.exp(-1.5)), abs(math.exp(-2.0) - math.exp(-1.8))]
    probability_diffs.append(abs(math.exp(-0.5) - math.exp(-0.3)))
    expected = {
        "rollout_corr/kl": -sum(log_ratios) / 3,
        "rollout_corr/k3_kl": sum(math.exp(x) - x - 1 for x in log_ratios) / 3,
        "rollout_corr/training_ppl": (math.exp(1.5) + math.exp(0.5)) / 2,
        "rollout_corr/training_log_ppl": (1.5 + 0.5) / 2,
        "rollout_corr/rollout_ppl": (math.exp(1.65) + math.exp(0.3)) / 2,
        "rollout_corr/rollout_log_ppl": (1.65 + 0.3) / 2,
        "rollout_corr/log_ppl_diff": (d[0] + d[1]) / 2,
        "rollout_corr/log_ppl_abs_diff": (abs(d[0]) + abs(d[1])) / 2,
        "rollout_corr/log_ppl_diff_max": max(d),
        "rollout_corr/log_ppl_diff_min": min(d),
        "rollout_corr/ppl_ratio": (math.exp(d[0]) + math.exp(d[1])) / 2,
        "rollout_corr/chi2_token": sum(math.exp(2 * x) for x in log_ratios) / 3 - 1,
        "rollout_corr/chi2_seq": (math.exp(2 * 0.3) + math.exp(2 * -0.2)) / 2 - 1,
        "training/rollout_probs_diff_mean": sum(probability_diffs) / 3,
        "training/rollout_probs_diff_max": max(probability_diffs),
        "mismatch/abs_log_prob_diff_mean": (0.5 + 0.2 + 0.2) / 3,
        "mismatch/abs_log_prob_diff_max": 0.5,
        "mismatch/ratio_mean": sum(ratios) / 3,
        "mismatch/ratio_p5": ratios[0],  # position 0.1 between two equal values
        "mismatch/ratio_p50": ratios[1],
        "mismatch/ratio_p95": ratios[1] + 0.9 * (ratios[2] - ratios[1]),  # position 1.9
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-12, abs=1e-12), name
        assert metrics[name].dim() == 0


def test_ratio_percentiles_on_a_known_vector_ignore_masked_entries() -> None:
    values = [4.0, 1.0, 5.0, 3.0, 2.0]  # sorted 1..5: p5 = 1 + 0.05 * 4, p50 = 3, p95 = 1 + 0.95 * 4
    old_logp = _tensor([[math.log(v) for v in values] + [math.log(100.0), NAN]])
    rollout_logp = torch.zeros_like(old_logp)
    mask = _tensor([[1, 1, 1, 1, 1, 0, 0]])
    metrics = rollout_mismatch_metrics(old_logp, rollout_logp, mask)
    assert metrics["mismatch/ratio_p5"].item() == pytest.approx(1.2, rel=1e-12)
    assert metrics["mismatch/ratio_p50"].item() == pytest.approx(3.0, rel=1e-12)
    assert metrics["mismatch/ratio_p95"].item() == pytest.approx(4.8, rel=1e-12)
    reference = torch.quantile(torch.tensor(values, dtype=F64), torch.tensor([0.05, 0.5, 0.95], dtype=F64))
    for name, value in zip(("p5", "p50", "p95"), reference):
        assert metrics[f"mismatch/ratio_{name}"].item() == pytest.approx(value.item(), rel=1e-12)

    single = rollout_mismatch_metrics(old_logp, rollout_logp, _tensor([[0, 0, 1, 0, 0, 0, 0]]))
    for name in ("p5", "p50", "p95"):
        assert single[f"mismatch/ratio_{name}"].item() == pytest.approx(5.0, rel=1e-12)


def test_random_percentiles_match_torch_quantile_over_the_valid_tokens() -> None:
    generator = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(6, 9, generator=generator, dtype=F64) * 3
    rollout_logp = old_logp + torch.randn(6, 9, generator=generator, dtype=F64) * 0.3
    mask = torch.rand(6, 9, generator=generator) < 0.6
    metrics = rollout_mismatch_metrics(old_logp, rollout_logp, mask)
    valid_ratios = torch.exp(old_logp - rollout_logp)[mask]
    reference = torch.quantile(valid_ratios, torch.tensor([0.05, 0.5, 0.95], dtype=F64))
    for name, value in zip(("p5", "p50", "p95"), reference):
        torch.testing.assert_close(metrics[f"mismatch/ratio_{name}"], value, rtol=1e-12, atol=0)


@pytest.mark.parametrize("shape", [(1, 2), (2, 0)])
def test_metrics_are_zero_without_valid_tokens(shape: tuple[int, int]) -> None:
    old_logp = torch.full(shape, NAN, dtype=F64)
    mask = torch.zeros(shape, dtype=F64)
    config = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0)
    result = compute_rollout_correction(old_logp, torch.zeros_like(old_logp), mask, config)
    for name, value in result.metrics.items():
        assert value.item() == 0.0, name
    torch.testing.assert_close(result.is_weights, torch.zeros(shape, dtype=F64), rtol=0, atol=0)


@pytest.mark.parametrize(
    "config",
    [
        RolloutCorrectionConfig(rollout_is="token"),
        RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="sequence", rollout_rs_threshold=1.5),
        RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-6),
        RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.01),
    ],
)
def test_identical_log_probs_give_unit_weights_no_rejection_and_zero_mismatch(config) -> None:
    generator = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 5, generator=generator, dtype=F64) * 4
    mask = (torch.rand(4, 5, generator=generator) < 0.7).to(F64)
    mask[0] = 1.0
    result = compute_rollout_correction(logp, logp.clone(), mask, config)
    torch.testing.assert_close(result.response_mask, mask, rtol=0, atol=0)
    if config.rollout_is is not None:
        torch.testing.assert_close(result.is_weights, mask, rtol=0, atol=0)
    zeros = [
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/log_ppl_diff_max",
        "rollout_corr/log_ppl_diff_min",
        "rollout_corr/chi2_token",
        "rollout_corr/chi2_seq",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "mismatch/abs_log_prob_diff_mean",
        "mismatch/abs_log_prob_diff_max",
        "mismatch/masked_token_fraction",
        "mismatch/masked_seq_fraction",
    ]
    ones = ["rollout_corr/ppl_ratio", "mismatch/ratio_mean", "mismatch/ratio_p5", "mismatch/ratio_p50"]
    ones.append("mismatch/ratio_p95")
    for name in zeros:
        assert result.metrics[name].item() == 0.0, name
    for name in ones:
        assert result.metrics[name].item() == pytest.approx(1.0, rel=1e-15), name
    torch.testing.assert_close(
        result.metrics["rollout_corr/training_ppl"], result.metrics["rollout_corr/rollout_ppl"], rtol=0, atol=0
    )


def test_disabled_config_keeps_the_mask_and_still_reports_the_mismatch() -> None:
    config = RolloutCorrectionConfig()
    assert not config.enabled
    old_logp, rollout_logp = _from_log_ratio([[5.0, -5.0, NAN]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.int64)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    assert result.is_weights is None
    assert result.response_mask.dtype == torch.int64
    assert torch.equal(result.response_mask, mask)
    _close(result.metrics["mismatch/abs_log_prob_diff_max"], 5.0)
    _close(result.metrics["mismatch/masked_token_fraction"], 0.0)
    assert "rollout_corr/rollout_is_mean" not in result.metrics
    assert "rollout_corr/rollout_rs_masked_fraction" not in result.metrics


def test_outputs_are_detached() -> None:
    old_logp = _tensor([[-1.0, -2.0]]).requires_grad_()
    rollout_logp = _tensor([[-1.2, -1.9]]).requires_grad_()
    mask = _tensor([[1, 1]])
    config = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    assert not result.is_weights.requires_grad and not result.response_mask.requires_grad
    assert not any(value.requires_grad for value in result.metrics.values())


def test_shape_mismatch_names_the_tensors() -> None:
    with pytest.raises(ValueError, match=r"rollout_logp \[2, 4\]"):
        compute_rollout_correction(
            torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), RolloutCorrectionConfig(rollout_is="token")
        )


# ----------------------------------------------------------------------------------------- config


def test_config_defaults_follow_verl() -> None:
    config = RolloutCorrectionConfig()
    assert config.rollout_is is None and config.rollout_rs is None
    assert config.rollout_is_threshold == 2.0
    assert config.rollout_rs_threshold is None and config.rollout_rs_threshold_lower is None
    assert config.rollout_token_veto_threshold is None and config.bypass_mode is False
    assert RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=4.0).rollout_rs_bounds == (0.25, 4.0)
    assert RolloutCorrectionConfig(rollout_token_veto_threshold=1e-4).enabled
    assert RolloutCorrectionConfig(bypass_mode=True).bypass_mode


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rollout_is="seq"), "rollout_is="),
        (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold"),
        (dict(rollout_rs="geo", rollout_rs_threshold=1.01), "rollout_rs="),
        (dict(rollout_rs="token"), "rollout_rs_threshold"),
        (dict(rollout_rs="token", rollout_rs_threshold=-1.0), "rollout_rs_threshold"),
        (dict(rollout_rs="token", rollout_rs_threshold=0.8), "rollout_rs_threshold must be > 1"),
        (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=2.0), "_lower must be in"),
        (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=-0.1), "_lower must be in"),
        (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold is set"),
        (dict(rollout_rs_threshold_lower=0.5), "rollout_rs_threshold_lower is set"),
        (dict(rollout_token_veto_threshold=0.0), "rollout_token_veto_threshold"),
        (dict(rollout_token_veto_threshold=1.0), "rollout_token_veto_threshold"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as error:
        RolloutCorrectionConfig(**kwargs)
    if field.endswith("="):  # unknown mode: the valid values are listed
        assert "None" in str(error.value) and "'token'" in str(error.value)


# -------------------------------------------------------------------------------- with the policy loss


def test_corrected_mask_and_weights_feed_the_policy_loss() -> None:
    old_logp, rollout_logp = _from_log_ratio([[0.5, -0.2, math.log(3.0)], [0.1, NAN, NAN]])
    old_logp = old_logp - 2.0
    rollout_logp = rollout_logp - 2.0
    mask = _tensor([[1, 1, 1], [1, 0, 0]])
    config = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.5)
    result = compute_rollout_correction(old_logp, rollout_logp, mask, config)
    torch.testing.assert_close(result.response_mask, _tensor([[1, 1, 0], [1, 0, 0]]), rtol=0, atol=0)

    # At ratio 1 with advantage 1 the per-token PPO loss is -w_t: token-mean over the 3 kept tokens.
    logp = torch.where(mask.bool(), old_logp, 0.0).clone().requires_grad_()
    loss, loss_metrics = ppo_policy_loss(
        logp, old_logp, torch.ones_like(old_logp), result.response_mask, rollout_is_weights=result.is_weights
    )
    loss.backward()
    kept_weights = [math.exp(0.5), math.exp(-0.2), math.exp(0.1)]
    assert loss.item() == pytest.approx(-sum(kept_weights) / 3, rel=1e-12)
    expected_grad = _tensor([[-kept_weights[0] / 3, -kept_weights[1] / 3, 0.0], [-kept_weights[2] / 3, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)
    assert all(torch.isfinite(value) for value in loss_metrics.values())

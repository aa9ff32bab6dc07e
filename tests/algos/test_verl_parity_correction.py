"""rlmega's rollout correction against verl's, with verl's results worked out by hand in plain Python.

verl/trainer/ppo/rollout_corr_helper.py and core_algos.py at commit b178a3cd5 (main, 2026-01-29: the k1 names)
and at tag v0.7.0 (the ratio names and the veto). Each reference follows verl's formula over Python floats.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from rlmega.algos import PPOLossConfig, ReinforceLossConfig, count_loss_denominators
from rlmega.algos.policy_loss_base import PolicyLossContext
from rlmega.algos.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction,
    correct_against_current_policy,
)
from rlmega.config import load_config
from rlmega.config.verl import VerlTranslationError, _defaults_tree, translate_verl_config
from rlmega.workers import heads
from rlmega.workers.batching import SequenceBatch, build_micro_batch
from rlmega.workers.config import PolicyLossConfig

F64 = torch.float64
# l = log pi_train - log pi_rollout; None is padding. Row 2 is fully masked.
LOG_RATIOS = [[0.3, -0.1, -1.0], [0.05, 0.1, None], [None, None, None], [-0.5, 0.2, 0.1]]


def _tensors(rows):
    """``(old_logp, rollout_logp, mask)`` with ``old - rollout`` the given log-ratios (rollout = -1)."""
    mask = torch.tensor([[value is not None for value in row] for row in rows])
    ratios = torch.tensor([[0.0 if value is None else value for value in row] for row in rows], dtype=F64)
    return ratios - 1.0, torch.full_like(ratios, -1.0), mask


def _valid(rows):
    return [[value for value in row if value is not None] for row in rows]


def _close(value: torch.Tensor, expected: float) -> None:
    assert float(value) == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------------------------ k1 rejection names


@pytest.mark.parametrize("mode", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
def test_k1_rejection_bands_log_rollout_over_train(mode):
    """rollout_corr_helper.py:222 (token_k1 = -clamp(log_ratio)), :271-275 (token_k1 kept where log(lower) <= k1 <=
    log(upper)), :282-289 (seq_sum_k1: the masked sum of token_k1), :301-308 (seq_mean_k1: its masked mean), :366-369
    (rollout_rs_masked_fraction over the valid tokens, rollout_rs_seq_masked_fraction over every row); bounds from
    the 'lower_upper' string (:120-131). An asymmetric band, lower 0.5, upper 1.2."""
    lower, upper = 0.5, 1.2
    keep = []
    for row in _valid(LOG_RATIOS):
        k1 = [-value for value in row]
        if mode == "token_k1":
            keep.append([math.log(lower) <= x <= math.log(upper) for x in k1])
            continue
        statistic = sum(k1) if mode == "seq_sum_k1" else (sum(k1) / len(k1) if k1 else 0.0)
        keep.append([math.log(lower) <= statistic <= math.log(upper)] * len(k1))
    num_tokens = sum(len(row) for row in keep)
    masked_fraction = sum(not kept for row in keep for kept in row) / num_tokens
    seq_masked_fraction = sum(not all(row) for row in keep) / len(keep)

    old, rollout, mask = _tensors(LOG_RATIOS)
    config = RolloutCorrectionConfig(rollout_rs=mode, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
    result = compute_rollout_correction(old, rollout, mask, config)
    ours = [row[:len(kept)].tolist() for row, kept in zip(result.response_mask, keep)]
    assert ours == keep
    assert any(not all(row) for row in keep) and any(all(row) and row for row in keep)  # the band bites, not always
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], masked_fraction)
    _close(result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], seq_masked_fraction)


def test_the_k1_band_is_the_ratio_band_mirrored():
    """v0.7.0 rollout_corr_helper.py:164 keeps exp(l) in [lower, upper]; main's token_k1 (:222, :275) keeps exp(-l)
    there: the same band under the two names differs, and lower/upper under one equals 1/upper, 1/lower under the
    other."""
    old, rollout, mask = _tensors(LOG_RATIOS)

    def kept(mode, lower, upper):
        config = RolloutCorrectionConfig(rollout_rs=mode, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
        return compute_rollout_correction(old, rollout, mask, config).response_mask

    by_ratio = [[math.log(0.5) <= value <= math.log(1.2) for value in row] for row in _valid(LOG_RATIOS)]
    assert [row[:len(want)].tolist() for row, want in zip(kept("token", 0.5, 1.2), by_ratio)] == by_ratio
    assert not torch.equal(kept("token", 0.5, 1.2), kept("token_k1", 0.5, 1.2))
    assert torch.equal(kept("token", 0.5, 1.2), kept("token_k1", 1 / 1.2, 1 / 0.5))
    assert torch.equal(kept("sequence", 0.5, 1.2), kept("seq_sum_k1", 1 / 1.2, 1 / 0.5))
    assert torch.equal(kept("geometric", 0.5, 1.2), kept("seq_mean_k1", 1 / 1.2, 1 / 0.5))


# ----------------------------------------------------------------------------------------------- metrics


def test_is_metrics_are_verls_before_truncation_and_over_every_row():
    """rollout_corr_helper.py:552-562 (the metrics are computed before the weights are truncated), :648-653
    (sequence level: rollout_is_ratio_fraction_high is a mean over every row, a fully masked row's log-ratio sum
    being 0), :655-663 (token level: the mean of the untruncated weights over the valid tokens)."""
    old, rollout, mask = _tensors(LOG_RATIOS)
    cap = 1.1
    valid = _valid(LOG_RATIOS)
    token = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="token",
                                                                                   rollout_is_threshold=cap))
    weights = [math.exp(value) for row in valid for value in row]
    _close(token.metrics["rollout_corr/rollout_is_mean"], sum(weights) / len(weights))
    _close(token.metrics["rollout_corr/rollout_is_ratio_fraction_high"], sum(w > cap for w in weights) / len(weights))

    sequence = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="sequence",
                                                                                      rollout_is_threshold=cap))
    sums = [sum(row) for row in valid]  # the fully masked row sums to 0
    per_token = [math.exp(s) for s, row in zip(sums, valid) for _ in row]
    _close(sequence.metrics["rollout_corr/rollout_is_mean"], sum(per_token) / len(per_token))
    _close(sequence.metrics["rollout_corr/rollout_is_ratio_fraction_high"], sum(s > math.log(cap) for s in sums) / 4)
    assert sum(s > math.log(cap) for s in sums) == 1  # row 1 only: 1/4 as verl, 1/3 over the rows with tokens


def test_mismatch_metrics_count_fully_masked_rows_as_verl():
    """rollout_corr_helper.py:876-937 (compute_offpolicy_metrics): per-sequence means are taken with masked_mean
    per row (0 for a row without valid tokens) and then averaged over every row, maxima and minima likewise."""
    old_rows = [[-1.0, -2.0, -0.5], [-0.3, -0.9, None], [None, None, None], [-1.5, -0.2, -0.7]]
    rollout_rows = [[-1.2, -1.9, 0.0], [-0.4, -0.6, None], [None, None, None], [-1.0, -0.5, -0.6]]
    mask = torch.tensor([[value is not None for value in row] for row in old_rows])
    old = torch.tensor([[0.0 if v is None else v for v in row] for row in old_rows], dtype=F64)
    rollout = torch.tensor([[0.0 if v is None else v for v in row] for row in rollout_rows], dtype=F64)
    metrics = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig()).metrics

    def row_mean(row):
        row = [v for v in row if v is not None]
        return sum(row) / len(row) if row else 0.0

    trainer = [row_mean(row) for row in old_rows]
    engine = [row_mean(row) for row in rollout_rows]
    diff = [e - t for e, t in zip(engine, trainer)]
    sums = [sum(o - r for o, r in zip(orow, rrow) if o is not None) for orow, rrow in zip(old_rows, rollout_rows)]
    expected = {
        "training_ppl": sum(math.exp(-m) for m in trainer) / 4,
        "training_log_ppl": sum(-m for m in trainer) / 4,
        "rollout_ppl": sum(math.exp(-m) for m in engine) / 4,
        "rollout_log_ppl": sum(-m for m in engine) / 4,
        "log_ppl_diff": sum(diff) / 4,
        "log_ppl_abs_diff": sum(abs(d) for d in diff) / 4,
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": sum(math.exp(d) for d in diff) / 4,
        "chi2_seq": sum(math.exp(2 * s) for s in sums) / 4 - 1,
    }
    for name, value in expected.items():
        _close(metrics[f"rollout_corr/{name}"], value)
    # The empty row's 0 is the minimum (every other row's difference is positive), as in verl.
    assert diff[2] == 0.0 and min(d for i, d in enumerate(diff) if i != 2) > 0.05
    assert float(metrics["rollout_corr/training_ppl"]) != pytest.approx(
        sum(math.exp(-m) for i, m in enumerate(trainer) if i != 2) / 3, abs=1e-3)


def test_veto_fraction_counts_every_row_as_verl_0_7():
    """v0.7.0 rollout_corr_helper.py:664-673: rollout_is_veto_fraction is the mean over every row of 'has a valid
    token below the threshold'; the catastrophic token fraction is over the valid tokens."""
    old, rollout, mask = _tensors(LOG_RATIOS)
    config = RolloutCorrectionConfig(rollout_token_veto_threshold=0.5)  # log 0.5 = -0.69: -1.0 is catastrophic
    metrics = compute_rollout_correction(old, rollout, mask, config).metrics
    _close(metrics["rollout_corr/rollout_is_veto_fraction"], 1 / 4)
    _close(metrics["rollout_corr/rollout_is_catastrophic_token_fraction"], 1 / 8)


# ------------------------------------------------------------------------------------------- bypass mode

LOGP = [[-1.0, -0.4, -2.0], [-0.3, -1.1, -0.8]]
ENGINE = [[-1.1, -0.9, -0.2], [-0.35, -1.0, -0.8]]  # l = 0.1, 0.5, -1.8 / 0.05, -0.1, 0
ADVANTAGES = [[1.0, -0.5, 2.0], [-1.0, 0.5, 1.5]]
BYPASS = RolloutCorrectionConfig(bypass_mode=True, rollout_is="token", rollout_is_threshold=1.5,
                                 rollout_rs="token_k1", rollout_rs_threshold=2.0)


def _verl_bypass(loss_type: str) -> tuple[float, list[list[float]]]:
    """core_algos.py:2143-2199 (compute_policy_loss_bypass_mode): IS weights and rejection from the *current*
    log-probs against the rollout's (:2148-2158), then REINFORCE with the weights (:2040, -A logp w) or the vanilla
    PPO loss without them (:2187-2192; dual clip c = 3, clip 0.2), token-mean over the kept tokens divided by the
    mini-batch's valid tokens before rejection (verl/workers/utils/losses.py:103-106, batch_num_tokens). Returns the
    loss and d loss / d logp."""
    loss, gradient, num_tokens = 0.0, [], sum(len(row) for row in LOGP)
    for logp_row, engine_row, advantage_row in zip(LOGP, ENGINE, ADVANTAGES):
        gradient.append([])
        for logp, engine, advantage in zip(logp_row, engine_row, advantage_row):
            log_ratio = logp - engine
            kept = math.log(1 / 2.0) <= -log_ratio <= math.log(2.0)
            weight, ratio = min(math.exp(log_ratio), 1.5), math.exp(log_ratio)
            if not kept:
                gradient[-1].append(0.0)
                continue
            if loss_type == "reinforce":
                loss += -advantage * logp * weight / num_tokens
                gradient[-1].append(-advantage * weight / num_tokens)
                continue
            unclipped, clipped = -advantage * ratio, -advantage * min(max(ratio, 0.8), 1.2)
            value, slope = (unclipped, -advantage * ratio) if unclipped >= clipped else (clipped, 0.0)
            if advantage < 0 and -advantage * 3.0 < value:
                value, slope = -advantage * 3.0, 0.0
            loss += value / num_tokens
            gradient[-1].append(slope / num_tokens)
    return loss, gradient


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_corrects_the_current_policy_against_the_engine(loss_type):
    """verl's bypass mode (core_algos.py:2064-2199) by hand, against correct_against_current_policy and the loss."""
    expected_loss, expected_gradient = _verl_bypass(loss_type)
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    engine, advantages = torch.tensor(ENGINE, dtype=F64), torch.tensor(ADVANTAGES, dtype=F64)
    mask = torch.ones_like(engine, dtype=torch.bool)
    ratio_free = loss_type == "reinforce"
    correction = correct_against_current_policy(logp, engine, mask, BYPASS, weights_apply=ratio_free)
    assert (correction.is_weights is not None) == ratio_free
    loss_config = (ReinforceLossConfig() if ratio_free
                   else PPOLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0))
    context = PolicyLossContext(global_denominators=count_loss_denominators(mask),
                                rollout_is_weights=correction.is_weights)
    loss, _ = loss_config.build()(logp, engine, advantages, correction.response_mask, context)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor(expected_gradient, dtype=F64), rtol=0, atol=1e-6)
    assert not correction.response_mask.all()  # the -1.8 log-ratio token leaves the band [1/2, 2]


@pytest.mark.parametrize("name, loss_type", [("reinforce", "reinforce"), ("ppo", "ppo_clip")])
def test_policy_head_applies_the_bypass_correction_per_micro_batch(monkeypatch, name, loss_type):
    """The actor's loss head in bypass mode (the batch carries the correction): the same loss and gradient as
    verl's bypass mode by hand, and the correction's metrics among the head's."""
    expected_loss, expected_gradient = _verl_bypass(loss_type)
    # The "logits" given are the log-probs themselves: the head's rows are the output, its log-probs those rows.
    monkeypatch.setattr(heads, "_scaled_rows", lambda micro_batch, output, logit_scale: output)
    monkeypatch.setattr(heads, "_row_logprobs", lambda micro_batch, rows, *args: (rows, torch.zeros_like(rows)))
    prompt = torch.tensor([5, 6])
    batch = SequenceBatch(
        [torch.cat([prompt, torch.tensor([1, 2, 3])]), torch.cat([prompt, torch.tensor([4, 5, 6])])], [2, 2],
        {"old_logp": [torch.tensor(row, dtype=F64) for row in ENGINE],
         "advantages": [torch.tensor(row, dtype=F64) for row in ADVANTAGES]},
        rollout_correction=BYPASS)
    config = PolicyLossConfig(name=name, **({} if name == "reinforce" else dict(clip_ratio_low=0.2,
                                                                                 clip_ratio_high=0.2,
                                                                                 clip_ratio_c=3.0)))
    head = heads.policy_head(batch, config, vocab_size=8, chunk_tokens=16, backward_scale=1.0)
    output = torch.tensor([value for row in LOGP for value in row], dtype=F64, requires_grad=True)
    result = head(build_micro_batch(batch, [0, 1], packing=False), output)
    result.loss.backward()
    assert float(result.summed["pg_loss"]) == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(output.grad, torch.tensor(sum(expected_gradient, []), dtype=F64), rtol=0, atol=1e-6)
    _close(result.metrics["rollout_corr/rollout_rs_masked_fraction"], 1 / 6)


# ------------------------------------------------------------------------------------------- --from-verl


def _verl_config(tmp_path, correction: dict):
    tree = _defaults_tree()
    tree["algorithm"]["adv_estimator"] = "grpo"
    tree["actor_rollout_ref"]["rollout"]["name"] = "vllm"
    tree["actor_rollout_ref"]["actor"]["strategy"] = tree["critic"]["strategy"] = "megatron"
    # verl's current rollout_correction section: no rollout_rs_threshold_lower, no veto
    for key in ("rollout_rs_threshold_lower", "rollout_token_veto_threshold"):
        tree["algorithm"]["rollout_correction"].pop(key)
    tree["algorithm"]["rollout_correction"].update(correction)
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_from_verl_loads_the_current_names(tmp_path):
    """verl/trainer/config/algorithm/rollout_correction.yaml at main: rollout_rs 'seq_mean_k1' with a 'lower_upper'
    threshold (rollout_corr_helper.py:120-131), loss_type in bypass mode (core_algos.py:2139, :2167-2199)."""
    overrides = translate_verl_config(_verl_config(tmp_path, {
        "rollout_is": "token", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.002"}))
    correction = load_config("tiny_cpu", overrides + [f"run_dir={tmp_path}"], check=False).algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_rs) == ("token", "seq_mean_k1")
    assert (correction.rollout_rs_threshold_lower, correction.rollout_rs_threshold) == (0.999, 1.002)
    assert correction.reject_before_advantages

    overrides = translate_verl_config(_verl_config(tmp_path, {
        "bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence", "rollout_rs": "token_k1",
        "rollout_rs_threshold": 1.5}))
    config = load_config("tiny_cpu", overrides + [f"run_dir={tmp_path}"], check=False)
    assert config.actor.policy_loss.name == "reinforce" and config.algorithm.rollout_correction.bypass_mode
    assert config.algorithm.rollout_correction.rollout_rs_bounds == (1 / 1.5, 1.5)

    # In bypass mode verl's ppo_clip is its vanilla (dual-clip) loss whatever loss_mode says (core_algos.py:2187).
    path = _verl_config(tmp_path, {"bypass_mode": True, "rollout_rs": "token_k1", "rollout_rs_threshold": 1.5})
    tree = yaml.safe_load(path.read_text())
    tree["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] = "gspo"
    path.write_text(yaml.safe_dump(tree))
    loss = load_config("tiny_cpu", translate_verl_config(path) + [f"run_dir={tmp_path}"], check=False).actor.policy_loss
    assert (loss.name, loss.clip_ratio_c) == ("ppo", 3.0)


@pytest.mark.parametrize("correction, reason", [
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": 0.01}, "k2/k3 divergence statistics"),
    ({"rollout_rs": "token_k1,seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"}, "comma-separated chains"),
    ({"rollout_rs": "token", "rollout_rs_threshold": "0.5_2.0"}, "only with its k1 options"),
])
def test_from_verl_refuses_what_rlmega_lacks_with_the_reason(tmp_path, correction, reason):
    with pytest.raises(VerlTranslationError, match=reason):
        translate_verl_config(_verl_config(tmp_path, correction))

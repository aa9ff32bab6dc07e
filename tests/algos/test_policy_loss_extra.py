"""REINFORCE/GPG, SAPO, GMPO, Clip-Cov, KL-Cov; the common signature and the log-ratio clamp of every loss.

Besides values by hand, each loss is compared with a loop restatement of verl's formula
(``verl/trainer/ppo/core_algos.py``) in plain Python floats, at 1e-10 in float64.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import pytest
import torch
from hypothesis import given

from rlmega.algos import (
    POLICY_LOSSES,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    kl_cov_policy_loss,
    reinforce_policy_loss,
    sapo_policy_loss,
)

from .helpers import AGG_MODES, ALL_POLICY_LOSSES, PROPERTY_SETTINGS, batch_shapes, make_batch, reference_aggregate

F64 = torch.float64
TIGHT = dict(rtol=0, atol=1e-10)


def _tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _valid(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Valid (row, column) positions in row-major order."""
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] != 0]


def _token_weights(mask: torch.Tensor, mode: str, horizon: float) -> dict[tuple[int, int], float]:
    """d(aggregate)/d(x_it) of each valid token: the weight it has in the aggregated loss."""
    lengths = {i: sum(1 for row, _ in _valid(mask) if row == i) for i in range(mask.shape[0])}
    num_tokens = sum(lengths.values())
    num_seqs = sum(1 for n in lengths.values() if n > 0)
    weights = {}
    for i, t in _valid(mask):
        weights[i, t] = {
            "token-mean": 1 / num_tokens,
            "seq-mean-token-sum": 1 / num_seqs,
            "seq-mean-token-mean": 1 / (lengths[i] * num_seqs),
            "seq-mean-token-sum-norm": 1 / (num_seqs * horizon),
        }[mode]
    return weights


def _per_token(mask: torch.Tensor, fn: Callable[[int, int], float]) -> torch.Tensor:
    values = torch.zeros(mask.shape, dtype=F64)
    for i, t in _valid(mask):
        values[i, t] = fn(i, t)
    return values


def _gradient(mask: torch.Tensor, mode: str, horizon: float, d_token: Callable[[int, int], float]) -> torch.Tensor:
    weights = _token_weights(mask, mode, horizon)
    return _per_token(mask, lambda i, t: weights[i, t] * d_token(i, t))


def _run(loss_fn, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_()
    loss, metrics = loss_fn(logp, *args, **kwargs)
    loss.backward()
    return loss, metrics, logp.grad


def _random_weights(seed: int, shape) -> torch.Tensor:
    return 0.5 + torch.rand(shape, dtype=F64, generator=torch.Generator().manual_seed(seed + 7))


# ------------------------------------------------------------------------------ common signature

COMMON_KEYWORDS = {"loss_agg_mode", "global_denominators", "norm_horizon", "rollout_is_weights"}
PPO_KEYWORDS = {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "log_ratio_clamp"}
OWN_KEYWORDS = {
    "ppo": PPO_KEYWORDS,
    "vanilla": PPO_KEYWORDS,
    "clip_higher": PPO_KEYWORDS,
    "dual_clip": PPO_KEYWORDS,
    "gspo": {"clip_ratio_low", "clip_ratio_high", "log_ratio_clamp"},
    "cispo": {"clip_ratio_low", "clip_ratio_high", "log_ratio_clamp"},
    "gpg": set(),
    "reinforce": set(),
    "sapo": {"tau_pos", "tau_neg", "log_ratio_clamp"},
    "geo_mean": {"clip_ratio_low", "clip_ratio_high", "log_ratio_clamp"},
    "clip_cov": {"clip_ratio_low", "clip_ratio_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                 "log_ratio_clamp", "generator"},
    "kl_cov": {"kl_cov_ratio", "ppo_kl_coef", "log_ratio_clamp"},
}


def test_own_keywords_cover_every_loss() -> None:
    assert sorted(OWN_KEYWORDS) == sorted(ALL_POLICY_LOSSES) == sorted(POLICY_LOSSES)


@pytest.mark.parametrize("loss_name", ALL_POLICY_LOSSES)
def test_common_signature_spelled_out(loss_name: str) -> None:
    parameters = inspect.signature(POLICY_LOSSES[loss_name]).parameters.values()
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert positional == ["logp", "old_logp", "advantages", "response_mask"]
    # No **kwargs: a caller filters its settings by these names.
    assert all(p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
    assert keyword_only == COMMON_KEYWORDS | OWN_KEYWORDS[loss_name]


@pytest.mark.parametrize("loss_name", ALL_POLICY_LOSSES)
def test_log_ratio_clamp_defaults(loss_name: str) -> None:
    parameters = inspect.signature(POLICY_LOSSES[loss_name]).parameters
    if loss_name in ("gpg", "reinforce"):
        assert "log_ratio_clamp" not in parameters  # no ratio, nothing to exponentiate
    else:
        assert parameters["log_ratio_clamp"].default == (10.0 if loss_name == "gspo" else 20.0)


def test_verl_defaults() -> None:
    def defaults(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()}

    assert defaults(sapo_policy_loss)["tau_pos"] == 1.0 and defaults(sapo_policy_loss)["tau_neg"] == 1.05
    assert defaults(sapo_policy_loss)["loss_agg_mode"] == "seq-mean-token-mean"
    clip_cov = defaults(clip_cov_policy_loss)
    assert (clip_cov["clip_cov_ratio"], clip_cov["clip_cov_lb"], clip_cov["clip_cov_ub"]) == (2e-4, 1.0, 5.0)
    kl_cov = defaults(kl_cov_policy_loss)
    assert (kl_cov["kl_cov_ratio"], kl_cov["ppo_kl_coef"]) == (2e-4, 0.1)
    geo_mean = defaults(geo_mean_policy_loss)
    assert (geo_mean["clip_ratio_low"], geo_mean["clip_ratio_high"]) == (0.4, 0.4)


# ---------------------------------------------------------------------------- log-ratio clamp

# One valid token with log-ratio 50 (or -50) and one padded token. Expected loss as a function of
# the log-ratio x that reaches exp: the clamp pins x at c.
CLAMP_CASES = [
    ("ppo", 50.0, -1.0, {}, math.exp),  # -A r, unclipped for A < 0 above the range
    ("vanilla", 50.0, -1.0, {}, math.exp),
    ("clip_higher", 50.0, -1.0, {}, math.exp),
    ("dual_clip", 50.0, -1.0, {"clip_ratio_c": 1e30}, math.exp),  # a dual bound far above
    ("gspo", 50.0, -1.0, {}, math.exp),
    ("cispo", -50.0, 1.0, {}, lambda x: -math.exp(x)),  # no lower bound: weight = r
    ("geo_mean", 50.0, -1.0, {}, math.exp),  # A < 0: unbounded above
    ("clip_cov", 50.0, -1.0, {}, math.exp),  # covariance 0: nothing removed
    ("kl_cov", 50.0, -1.0, {}, lambda x: math.exp(x) + 0.1 * 50.0),  # the single token is penalised
]


def test_clamp_cases_cover_every_ratio_loss() -> None:
    assert sorted(name for name, *_ in CLAMP_CASES) == sorted(set(ALL_POLICY_LOSSES) - {"gpg", "reinforce", "sapo"})


@pytest.mark.parametrize(("loss_name", "log_ratio", "advantage", "kwargs", "expected"), CLAMP_CASES)
def test_log_ratio_clamp(loss_name, log_ratio, advantage, kwargs, expected) -> None:
    old_logp = _tensor([[-60.0, -1.0]])
    logp = old_logp + _tensor([[log_ratio, 3.0]])
    adv = _tensor([[advantage, 1.0]])
    mask = _tensor([[1, 0]])
    loss_fn = POLICY_LOSSES[loss_name]
    default_clamp = 10.0 if loss_name == "gspo" else 20.0
    clamped, _ = loss_fn(logp, old_logp, adv, mask, **kwargs)
    unclamped, _ = loss_fn(logp, old_logp, adv, mask, log_ratio_clamp=None, **kwargs)
    custom, _ = loss_fn(logp, old_logp, adv, mask, log_ratio_clamp=5.0, **kwargs)
    sign = math.copysign(1.0, log_ratio)
    assert clamped.item() == pytest.approx(expected(sign * default_clamp), rel=1e-12)
    assert unclamped.item() == pytest.approx(expected(log_ratio), rel=1e-12)
    assert custom.item() == pytest.approx(expected(sign * 5.0), rel=1e-12)


def test_clamped_token_has_no_gradient() -> None:
    old_logp = _tensor([[-60.0, -1.0]])
    logp = old_logp + _tensor([[50.0, 0.0]])
    adv, mask = _tensor([[-1.0, -1.0]]), _tensor([[1, 1]])
    _, _, clamped_grad = _run(POLICY_LOSSES["ppo"], logp, old_logp, adv, mask)
    _, _, unclamped_grad = _run(POLICY_LOSSES["ppo"], logp, old_logp, adv, mask, log_ratio_clamp=None)
    torch.testing.assert_close(clamped_grad, _tensor([[0.0, 0.5]]), rtol=0, atol=1e-12)  # -A r / 2 at r = 1
    torch.testing.assert_close(unclamped_grad, _tensor([[math.exp(50.0) / 2, 0.5]]), rtol=1e-12, atol=0)


def test_sapo_clamp_keeps_the_gradient_finite() -> None:
    # r = e^1000 overflows to inf: the gate saturates (value 4/tau) but its backward is 0 * inf = nan.
    old_logp = _tensor([[-1000.0, -1.0]])
    logp = old_logp + _tensor([[1000.0, 0.0]])
    adv, mask = _tensor([[1.0, 1.0]]), _tensor([[1, 1]])
    loss, _, grad = _run(sapo_policy_loss, logp, old_logp, adv, mask)
    assert loss.item() == pytest.approx(-(4.0 + 2.0) / 2, abs=1e-12)  # gate 4 (saturated) and 2 (r = 1)
    assert torch.isfinite(grad).all()
    _, _, unclamped_grad = _run(sapo_policy_loss, logp, old_logp, adv, mask, log_ratio_clamp=None)
    assert torch.isnan(unclamped_grad[0, 0])


def test_nonpositive_log_ratio_clamp_is_rejected() -> None:
    ok = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        POLICY_LOSSES["ppo"](ok, ok, ok, torch.ones(1, 1), log_ratio_clamp=0.0)


# ------------------------------------------------------------------------------ REINFORCE / GPG

REINFORCE_LOGP = _tensor([[-1.0, -2.0, 9.0], [-0.5, 7.0, 7.0]])
REINFORCE_ADV = _tensor([[1.0, 1.0, 5.0], [-2.0, 5.0, 5.0]])
REINFORCE_MASK = _tensor([[1, 1, 0], [1, 0, 0]])


def test_gpg_and_reinforce_are_one_function() -> None:
    assert POLICY_LOSSES["gpg"] is POLICY_LOSSES["reinforce"] is reinforce_policy_loss


def test_reinforce_by_hand() -> None:
    old_logp = REINFORCE_LOGP + 0.1
    loss, metrics, grad = _run(reinforce_policy_loss, REINFORCE_LOGP, old_logp, REINFORCE_ADV, REINFORCE_MASK)
    # -(1 * -1 + 1 * -2 + -2 * -0.5) / 3 tokens
    assert loss.item() == pytest.approx(2 / 3, abs=1e-12)
    torch.testing.assert_close(grad, _tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(0.1, abs=1e-12)

    weights = _tensor([[0.5, 2.0, 9.0], [1.0, 9.0, 9.0]])
    loss, _, grad = _run(
        reinforce_policy_loss, REINFORCE_LOGP, old_logp, REINFORCE_ADV, REINFORCE_MASK, rollout_is_weights=weights
    )
    assert loss.item() == pytest.approx(-(0.5 * -1 + 2 * -2 + 1 * 1) / 3, abs=1e-12)
    torch.testing.assert_close(grad, _tensor([[-0.5 / 3, -2 / 3, 0.0], [2 / 3, 0.0, 0.0]]), rtol=0, atol=1e-12)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_reinforce_matches_verl_and_its_gradient_is_minus_weighted_advantage(mode: str, shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    weights = _random_weights(seed, batch.mask.shape)
    loss, _, grad = _run(
        reinforce_policy_loss, batch.logp, batch.old_logp, batch.advantages, batch.mask,
        loss_agg_mode=mode, norm_horizon=num_tokens, rollout_is_weights=weights,
    )
    # verl: pg_losses = -log_prob * advantages * rollout_is_weights
    expected = _per_token(
        batch.mask, lambda i, t: -float(batch.logp[i, t]) * float(batch.advantages[i, t]) * float(weights[i, t])
    )
    assert loss.item() == pytest.approx(reference_aggregate(expected, batch.mask, mode, num_tokens), abs=1e-10)
    # the point of REINFORCE: grad = -w A grad logp, weighted like every token of the aggregation
    expected_grad = _gradient(
        batch.mask, mode, num_tokens, lambda i, t: -float(weights[i, t]) * float(batch.advantages[i, t])
    )
    torch.testing.assert_close(grad, expected_grad, **TIGHT)


# ----------------------------------------------------------------------------------------- SAPO


def test_sapo_by_hand() -> None:
    # token 0: r = 1.5, A = +1 -> tau_pos = 1:    gate = 4 sigmoid(0.5)
    # token 1: r = 0.8, A = -2 -> tau_neg = 1.05: gate = 4 / 1.05 * sigmoid(1.05 * -0.2)
    old_logp = _tensor([[-1.0, -2.0, -1.0]])
    logp = old_logp + _tensor([[math.log(1.5), math.log(0.8), 30.0]])
    adv, mask = _tensor([[1.0, -2.0, 4.0]]), _tensor([[1, 1, 0]])
    loss, metrics, grad = _run(sapo_policy_loss, logp, old_logp, adv, mask)
    s0, s1 = _sigmoid(0.5), _sigmoid(-0.21)
    # seq-mean-token-mean over one sequence of 2 tokens
    assert loss.item() == pytest.approx((-4 * s0 + 2 * 4 / 1.05 * s1) / 2, abs=1e-12)
    # d/dlogp = -A * 4 s (1 - s) * r, over 2 tokens
    expected_grad = _tensor([[-4 * s0 * (1 - s0) * 1.5 / 2, 2 * 4 * s1 * (1 - s1) * 0.8 / 2, 0.0]])
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.8)) / 2, abs=1e-12)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_sapo_at_ratio_one_has_ppo_gradient(mode: str, shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    loss, _, grad = _run(
        sapo_policy_loss, batch.old_logp, batch.old_logp, batch.advantages, batch.mask,
        loss_agg_mode=mode, norm_horizon=num_tokens, tau_pos=1.5, tau_neg=2.5,
    )
    tau = torch.where(batch.advantages > 0, 1.5, 2.5).to(F64)
    assert loss.item() == pytest.approx(
        reference_aggregate(-2 / tau * batch.advantages, batch.mask, mode, num_tokens), abs=1e-12
    )
    expected_grad = _gradient(batch.mask, mode, num_tokens, lambda i, t: -float(batch.advantages[i, t]))
    torch.testing.assert_close(grad, expected_grad, **TIGHT)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_sapo_matches_verl(mode: str, shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens, log_ratio_scale=1.0)
    weights = _random_weights(seed, batch.mask.shape)
    tau_pos, tau_neg = 1.0, 1.05
    loss, _, grad = _run(
        sapo_policy_loss, batch.logp, batch.old_logp, batch.advantages, batch.mask,
        loss_agg_mode=mode, norm_horizon=num_tokens, rollout_is_weights=weights,
    )

    def gate_terms(i: int, t: int) -> tuple[float, float, float, float]:
        ratio = math.exp(max(-20.0, min(20.0, float(batch.logp[i, t] - batch.old_logp[i, t]))))
        advantage = float(batch.advantages[i, t])
        tau = tau_pos if advantage > 0 else tau_neg
        return _sigmoid(tau * (ratio - 1.0)), tau, ratio, advantage

    def token_loss(i: int, t: int) -> float:
        sigmoid, tau, _, advantage = gate_terms(i, t)
        return -sigmoid * 4.0 / tau * advantage * float(weights[i, t])

    def token_grad(i: int, t: int) -> float:
        sigmoid, _, ratio, advantage = gate_terms(i, t)
        return -advantage * 4.0 * sigmoid * (1.0 - sigmoid) * ratio * float(weights[i, t])

    expected = reference_aggregate(_per_token(batch.mask, token_loss), batch.mask, mode, num_tokens)
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    torch.testing.assert_close(grad, _gradient(batch.mask, mode, num_tokens, token_grad), **TIGHT)


def test_sapo_rejects_nonpositive_temperature() -> None:
    ok = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="tau_pos"):
        sapo_policy_loss(ok, ok, ok, torch.ones(1, 1), tau_neg=0.0)


# ----------------------------------------------------------------------------------------- GMPO

# Sequence 0: A = +1, log-ratios (0.5, -0.1) -> clipped (0.4, -0.1), mean 0.15, L0 = -e^0.15.
# Sequence 1: A = -1, log-ratios (-0.6, 0.2, 0.1) -> clipped (-0.4, 0.2, 0.1), mean -1/30, L1 = e^(-1/30).
GMPO_OLD = _tensor([[-1.0, -2.0, -1.0], [-0.5, -1.5, -2.5]])
GMPO_LOGP = GMPO_OLD + _tensor([[0.5, -0.1, 40.0], [-0.6, 0.2, 0.1]])
GMPO_ADV = _tensor([[1.0, 1.0, 9.0], [-1.0, -1.0, -1.0]])
GMPO_MASK = _tensor([[1, 1, 0], [1, 1, 1]])


def test_geo_mean_by_hand() -> None:
    loss, metrics, grad = _run(geo_mean_policy_loss, GMPO_LOGP, GMPO_OLD, GMPO_ADV, GMPO_MASK)
    l0, l1 = -math.exp(0.15), math.exp(-1 / 30)
    assert loss.item() == pytest.approx((l0 + l1) / 2, abs=1e-12)  # mean over 2 sequences
    # clipped tokens get nothing; the others d L_i / d logp = -A_i e^(mean) / n_i, over 2 sequences
    expected_grad = _tensor([[0.0, l0 / 2 / 2, 0.0], [0.0, l1 / 3 / 2, l1 / 3 / 2]])
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)


def test_geo_mean_rollout_weights_enter_as_geometric_mean_per_sequence() -> None:
    weights = _tensor([[0.25, 1.0, 0.0], [2.0, 2.0, 2.0]])  # geometric means 0.5 and 2
    loss, _ = geo_mean_policy_loss(GMPO_LOGP, GMPO_OLD, GMPO_ADV, GMPO_MASK, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((0.5 * -math.exp(0.15) + 2 * math.exp(-1 / 30)) / 2, abs=1e-12)


def test_geo_mean_token_mean_weights_sequences_by_length() -> None:
    loss, _ = geo_mean_policy_loss(GMPO_LOGP, GMPO_OLD, GMPO_ADV, GMPO_MASK, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx((2 * -math.exp(0.15) + 3 * math.exp(-1 / 30)) / 5, abs=1e-12)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
def test_geo_mean_matches_verl(shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    # GMPO (and verl's implementation) is for per-sequence advantages
    advantages = batch.scores.unsqueeze(-1).expand_as(batch.logp)
    weights = _random_weights(seed, batch.mask.shape)
    low, high = 0.3, 0.2
    loss, _, grad = _run(
        geo_mean_policy_loss, batch.logp, batch.old_logp, advantages, batch.mask,
        clip_ratio_low=low, clip_ratio_high=high, rollout_is_weights=weights,
    )

    # verl, row by row: sign(A) * min(sign(A) l, sign(A) clip(l, -low, high)), exp of its mean,
    # times the mean advantage and the geometric-mean IS weight. (verl also divides by n + 1e-8
    # and averages over all rows, empty ones included; here over the non-empty rows.)
    sequence_losses, expected_grad = [], torch.zeros_like(batch.logp)
    for i in range(batch_size):
        columns = [t for t in range(num_tokens) if batch.mask[i, t] != 0]
        if not columns:
            continue
        kept_log_ratios, unclipped = [], []
        for t in columns:
            log_ratio = float(batch.logp[i, t] - batch.old_logp[i, t])
            sign = math.copysign(1.0, float(advantages[i, t])) if advantages[i, t] != 0 else 0.0
            clipped = max(-low, min(high, log_ratio))
            kept_log_ratios.append(sign * min(sign * log_ratio, sign * clipped))
            unclipped.append(sign != 0 and sign * log_ratio <= sign * clipped)  # the min keeps l
        n = len(columns)
        ratio = math.exp(sum(kept_log_ratios) / n)
        advantage = sum(float(advantages[i, t]) for t in columns) / n
        weight = math.exp(sum(math.log(float(weights[i, t])) for t in columns) / n)
        sequence_losses.append(-advantage * ratio * weight)
        for t, flows in zip(columns, unclipped):
            expected_grad[i, t] = -advantage * ratio * weight / n if flows else 0.0
    expected = sum(sequence_losses) / len(sequence_losses) if sequence_losses else 0.0
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    torch.testing.assert_close(grad, expected_grad / max(len(sequence_losses), 1), **TIGHT)


def test_geo_mean_rejects_negative_clip() -> None:
    ok = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        geo_mean_policy_loss(ok, ok, ok, torch.ones(1, 1), clip_ratio_low=-0.1)


# ------------------------------------------------------------------------------ Clip-Cov / KL-Cov

# One sequence of 4 valid tokens and a padded one. A = (2, -2, 1, 0) has mean 0.25 and
# logp = (-1, -3, -2, -2) mean -2, so the covariance (A - 0.25)(logp + 2) is (1.75, 2.25, 0, 0).
COV_LOGP = _tensor([[-1.0, -3.0, -2.0, -2.0, 50.0]])
COV_ADV = _tensor([[2.0, -2.0, 1.0, 0.0, 8.0]])
COV_MASK = _tensor([[1, 1, 1, 1, 0]])


def test_clip_cov_by_hand() -> None:
    # At ratio 1, with the window (1, 2): only token 0 (cov 1.75) is a candidate; k = 1 removes it.
    # Kept: -A r = +2, -1, 0 over 4 tokens.
    loss, metrics, grad = _run(clip_cov_policy_loss, COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, clip_cov_ub=2.0)
    assert loss.item() == pytest.approx((2 - 1 + 0) / 4, abs=1e-12)
    torch.testing.assert_close(grad, _tensor([[0.0, 0.5, -0.25, 0.0, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["clip_cov_frac"].item() == pytest.approx(1 / 4)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_clip_cov_ignores_ratio_clipped_tokens() -> None:
    # Token 0 now has ratio 1.5 with A > 0: PPO clips it (loss -2 * 1.2), so it is no candidate and,
    # in the window (1, 2), nothing is removed.
    old_logp = COV_LOGP - _tensor([[math.log(1.5), 0, 0, 0, 0]])
    loss, metrics = clip_cov_policy_loss(COV_LOGP, old_logp, COV_ADV, COV_MASK, clip_cov_ub=2.0)
    assert loss.item() == pytest.approx((-2 * 1.2 + 2 - 1 + 0) / 4, abs=1e-12)
    assert metrics["clip_cov_frac"].item() == 0.0
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(1 / 4)


def test_clip_cov_draw_is_reproducible_with_a_generator() -> None:
    # Default window (1, 5): tokens 0 and 1 are candidates, k = 1 of them is drawn.
    outcomes = set()
    for seed in range(8):
        first, metrics = clip_cov_policy_loss(
            COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, generator=torch.Generator().manual_seed(seed)
        )
        again, _ = clip_cov_policy_loss(
            COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, generator=torch.Generator().manual_seed(seed)
        )
        assert first.item() == again.item()
        assert metrics["clip_cov_frac"].item() == pytest.approx(1 / 4)
        outcomes.add(round(first.item(), 12))
    # removing token 0 leaves (2 - 1) / 4, removing token 1 leaves (-2 - 1) / 4
    assert outcomes <= {0.25, -0.75}


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_clip_cov_matches_verl(mode: str, shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    advantages = 2 * batch.advantages  # more covariances inside (lb, ub)
    weights = _random_weights(seed, batch.mask.shape)
    settings = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=0.3, clip_cov_lb=0.5, clip_cov_ub=3.0)
    loss, metrics, grad = _run(
        clip_cov_policy_loss, batch.logp, batch.old_logp, advantages, batch.mask,
        loss_agg_mode=mode, norm_horizon=num_tokens, rollout_is_weights=weights,
        generator=torch.Generator().manual_seed(seed), **settings,
    )

    valid = _valid(batch.mask)
    mean_advantage = sum(float(advantages[p]) for p in valid) / max(len(valid), 1)
    mean_logp = sum(float(batch.logp[p]) for p in valid) / max(len(valid), 1)
    surrogate, candidates = {}, []
    for p in valid:
        ratio = math.exp(max(-20.0, min(20.0, float(batch.logp[p] - batch.old_logp[p]))))
        advantage = float(advantages[p])
        unclipped_loss = -advantage * ratio
        clipped_loss = -advantage * min(max(ratio, 1 - settings["clip_ratio_low"]), 1 + settings["clip_ratio_high"])
        clipped_by_ratio = clipped_loss > unclipped_loss
        surrogate[p] = (max(unclipped_loss, clipped_loss), 0.0 if clipped_by_ratio else unclipped_loss)
        covariance = (advantage - mean_advantage) * (float(batch.logp[p]) - mean_logp)
        if not clipped_by_ratio and settings["clip_cov_lb"] < covariance < settings["clip_cov_ub"]:
            candidates.append(p)  # row-major, as torch.nonzero lists them
    removed = set()
    if candidates:
        num_to_remove = max(int(settings["clip_cov_ratio"] * len(valid)), 1)
        order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
        removed = {candidates[j] for j in order[:num_to_remove].tolist()}

    def token_loss(i, t):
        return 0.0 if (i, t) in removed else surrogate[i, t][0] * float(weights[i, t])

    def token_grad(i, t):  # d(-A r)/dlogp = -A r where the surrogate is unclipped
        return 0.0 if (i, t) in removed else surrogate[i, t][1] * float(weights[i, t])

    expected = reference_aggregate(_per_token(batch.mask, token_loss), batch.mask, mode, num_tokens)
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    torch.testing.assert_close(grad, _gradient(batch.mask, mode, num_tokens, token_grad), **TIGHT)
    assert metrics["clip_cov_frac"].item() == pytest.approx(len(removed) / max(len(valid), 1), abs=1e-12)


def test_kl_cov_by_hand() -> None:
    # Log-ratios (0.1, -0.2, 0.3, 0); kl_cov_ratio 0.5 -> k = 2: the top covariances, tokens 1 and 0,
    # get + |l|. Loss: (-2 e^0.1 + 0.1) + (2 e^-0.2 + 0.2) + (-e^0.3) + 0, over 4 tokens.
    old_logp = COV_LOGP - _tensor([[0.1, -0.2, 0.3, 0.0, 0.0]])
    loss, metrics, grad = _run(
        kl_cov_policy_loss, COV_LOGP, old_logp, COV_ADV, COV_MASK, kl_cov_ratio=0.5, ppo_kl_coef=1.0
    )
    e01, e02, e03 = math.exp(0.1), math.exp(-0.2), math.exp(0.3)
    assert loss.item() == pytest.approx((-2 * e01 + 0.1 + 2 * e02 + 0.2 - e03) / 4, abs=1e-12)
    # -A r + sign(l) on penalised tokens
    expected_grad = _tensor([[(-2 * e01 + 1) / 4, (2 * e02 - 1) / 4, -e03 / 4, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["kl_cov_frac"].item() == pytest.approx(0.5)
    assert metrics["ppo_kl_abs"].item() == pytest.approx(0.15, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(-0.05, abs=1e-12)

    # default ratio 2e-4: k = 1, only token 1 (cov 2.25)
    loss, metrics = kl_cov_policy_loss(COV_LOGP, old_logp, COV_ADV, COV_MASK, ppo_kl_coef=1.0)
    assert loss.item() == pytest.approx((-2 * e01 + 2 * e02 + 0.2 - e03) / 4, abs=1e-12)
    assert metrics["kl_cov_frac"].item() == pytest.approx(0.25)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_cov_matches_verl(mode: str, shape) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    weights = _random_weights(seed, batch.mask.shape)
    kl_cov_ratio, ppo_kl_coef = 0.3, 0.7
    loss, metrics, grad = _run(
        kl_cov_policy_loss, batch.logp, batch.old_logp, batch.advantages, batch.mask,
        loss_agg_mode=mode, norm_horizon=num_tokens, rollout_is_weights=weights,
        kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef,
    )

    valid = _valid(batch.mask)
    penalised = set()
    if valid:
        mean_advantage = sum(float(batch.advantages[p]) for p in valid) / len(valid)
        mean_logp = sum(float(batch.logp[p]) for p in valid) / len(valid)
        covariance = {
            p: (float(batch.advantages[p]) - mean_advantage) * (float(batch.logp[p]) - mean_logp) for p in valid
        }
        num_penalised = max(1, int(len(valid) * kl_cov_ratio))
        penalised = set(sorted(valid, key=lambda p: -covariance[p])[:num_penalised])

    def terms(i, t):
        log_ratio = float(batch.logp[i, t] - batch.old_logp[i, t])
        return log_ratio, math.exp(max(-20.0, min(20.0, log_ratio))), float(batch.advantages[i, t])

    def token_loss(i, t):
        log_ratio, ratio, advantage = terms(i, t)
        penalty = ppo_kl_coef * abs(log_ratio) if (i, t) in penalised else 0.0
        return (-advantage * ratio + penalty) * float(weights[i, t])

    def token_grad(i, t):
        log_ratio, ratio, advantage = terms(i, t)
        penalty = ppo_kl_coef * math.copysign(1.0, log_ratio) if (i, t) in penalised else 0.0
        return (-advantage * ratio + penalty) * float(weights[i, t])

    expected = reference_aggregate(_per_token(batch.mask, token_loss), batch.mask, mode, num_tokens)
    assert loss.item() == pytest.approx(expected, abs=1e-10)
    torch.testing.assert_close(grad, _gradient(batch.mask, mode, num_tokens, token_grad), **TIGHT)
    assert metrics["kl_cov_frac"].item() == pytest.approx(len(penalised) / max(len(valid), 1), abs=1e-12)


@pytest.mark.parametrize(
    ("loss_fn", "kwargs", "message"),
    [
        (clip_cov_policy_loss, {"clip_cov_ratio": 0.0}, "clip_cov_ratio"),
        (kl_cov_policy_loss, {"kl_cov_ratio": 0.0}, "kl_cov_ratio"),
        (kl_cov_policy_loss, {"kl_cov_ratio": 1.5}, "kl_cov_ratio"),
        (kl_cov_policy_loss, {"ppo_kl_coef": -1.0}, "ppo_kl_coef"),
    ],
)
def test_covariance_losses_reject_bad_settings(loss_fn, kwargs, message) -> None:
    ok = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match=message):
        loss_fn(ok, ok, ok, torch.ones(1, 1), **kwargs)

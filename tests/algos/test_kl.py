"""KL estimators, KL loss, KL in the reward and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmega.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_full,
    kl_loss,
    kl_low_var,
)

from .helpers import AGG_MODES, PROPERTY_SETTINGS, batch_shapes, garbage_like, make_batch, with_padding

F64 = torch.float64
LN2 = math.log(2.0)

# Token 0: p = 0.5, p_ref = 0.25 (d = ref - logp = -ln 2); token 1: p = 0.25, p_ref = 0.5 (d = ln 2).
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64)
REF_LOGP = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=F64)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [LN2, -LN2]),
        (("abs",), [LN2, LN2]),
        (("k2", "mse"), [0.5 * LN2**2, 0.5 * LN2**2]),  # 0.2402 each
        (("k3", "low_var_kl"), [0.5 + LN2 - 1, 2 - LN2 - 1]),  # e^d - d - 1: 0.1931, 0.3069
    ],
)
def test_estimators_by_hand(names: tuple[str, ...], expected: list[float]) -> None:
    for name in names:
        torch.testing.assert_close(KL_ESTIMATORS[name](LOGP, REF_LOGP), torch.tensor([expected], dtype=F64))


def test_low_var_kl_is_clamped_with_finite_zero_gradient() -> None:
    logp = torch.tensor([[0.0, -30.0]], dtype=F64, requires_grad=True)
    ref_logp = torch.tensor([[-30.0, 0.0]], dtype=F64)
    kl = kl_low_var(logp, ref_logp)
    kl.sum().backward()
    # d = -30 -> clamped to -20: e^-20 + 20 - 1 = 19.0 > 10; d = +30 -> e^20 - 21 > 10. Both clamp to 10.
    torch.testing.assert_close(kl, torch.tensor([[10.0, 10.0]], dtype=F64))
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=F64))


def test_low_var_kl_gradient_by_hand() -> None:
    # d/dlogp (e^d - d - 1) with d = ref - logp is 1 - e^d: token 0 -> 1 - 0.5, token 1 -> 1 - 2
    logp = LOGP.clone().requires_grad_()
    kl_low_var(logp, REF_LOGP).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -1.0]], dtype=F64))


def test_full_kl_by_hand_with_masked_vocabulary() -> None:
    # p = (0.5, 0.5), q = (0.25, 0.75): 0.5 ln 2 + 0.5 ln(0.5/0.75) = 0.1438
    # p = (0.5, 0.5, 0), q = (0.25, 0.7, 0.05): the p = 0 entry (logp = -inf) contributes 0.
    logp = torch.tensor(
        [[[math.log(0.5), math.log(0.5), -math.inf], [math.log(0.5), math.log(0.5), -math.inf]]], dtype=F64
    ).requires_grad_()
    ref = torch.tensor(
        [[[math.log(0.25), math.log(0.75), -math.inf], [math.log(0.25), math.log(0.7), math.log(0.05)]]], dtype=F64
    )
    kl = kl_full(logp, ref)
    expected = [0.5 * LN2 + 0.5 * math.log(0.5 / 0.75), 0.5 * LN2 + 0.5 * math.log(0.5 / 0.7)]
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=F64))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp_v of p_v (logp_v - ref_v) = p_v (logp_v - ref_v + 1); 0 where p_v = 0
    assert logp.grad[0, 0, 0].item() == pytest.approx(0.5 * (LN2 + 1))
    assert logp.grad[0, 0, 2].item() == 0.0


def test_full_kl_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"logp \[1, 2, 3\], ref_logp \[1, 2, 4\]"):
        kl_full(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))


def test_kl_loss_by_hand() -> None:
    logp = torch.cat([LOGP, torch.tensor([[50.0]], dtype=F64)], dim=-1).requires_grad_()  # padding token
    ref = torch.cat([REF_LOGP, torch.tensor([[-50.0]], dtype=F64)], dim=-1)
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    loss, metrics = kl_loss(logp, ref, mask, coef=0.1)  # low_var_kl, token-mean
    loss.backward()
    # k3 values 0.5 + ln2 - 1 and 1 - ln2 sum to 0.5 -> mean 0.25, times 0.1
    assert loss.item() == pytest.approx(0.025, abs=1e-12)
    assert metrics["kl_loss"].item() == pytest.approx(0.25, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.5 / 2, 0.1 * -1.0 / 2, 0.0]], dtype=F64))


def test_kl_loss_full_estimator_uses_token_mask() -> None:
    logp = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]], dtype=F64))
    ref = torch.log(torch.tensor([[[0.25, 0.75], [0.1, 0.9]]], dtype=F64))
    loss, _ = kl_loss(logp, ref, torch.tensor([[1, 0]]), coef=1.0, estimator="full")
    assert loss.item() == pytest.approx(0.5 * LN2 + 0.5 * math.log(0.5 / 0.75), abs=1e-12)


def test_kl_loss_rejects_bad_shapes_and_names() -> None:
    with pytest.raises(ValueError, match=r"ref_logp \[1, 3\]"):
        kl_loss(LOGP, torch.zeros(1, 3, dtype=F64), torch.ones(1, 2))
    with pytest.raises(ValueError, match="'full' expects"):
        kl_loss(LOGP, REF_LOGP, torch.ones(1, 2), estimator="full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_loss(LOGP, REF_LOGP, torch.ones(1, 2), estimator="k4")


def test_apply_kl_penalty_by_hand() -> None:
    # k1 per token: row 0 (0.1, 0.2), row 1 (0.3); beta = 0.5; scores 1 and 2 on the last valid token.
    ref = torch.zeros(2, 3, dtype=F64)
    logp = torch.tensor([[0.1, 0.2, 7.0], [0.3, 7.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)
    rewards, metrics = apply_kl_penalty(torch.tensor([1.0, 2.0], dtype=F64), logp, ref, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.05, 1 - 0.1, 0.0], [2 - 0.15, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-12)
    assert metrics["kl_token_mean"].item() == pytest.approx(0.6 / 3)
    assert metrics["kl_seq_sum_mean"].item() == pytest.approx((0.3 + 0.3) / 2)
    assert metrics["kl_coef"].item() == 0.5


def test_apply_kl_penalty_rejects_bad_scores() -> None:
    with pytest.raises(ValueError, match=r"scores \[3\]"):
        apply_kl_penalty(torch.zeros(3), LOGP, REF_LOGP, torch.ones(1, 2), kl_coef=0.1)


def test_fixed_controller_never_changes() -> None:
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_controller_by_hand() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 9/6 - 1 = 0.5 -> clipped to 0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))  # 0.100512
    controller.update(current_kl=5.4, n_steps=256)  # error 5.4/6 - 1 = -0.1, not clipped
    assert controller.value == pytest.approx(0.100512 * (1 - 0.1 * 256 / 10000))  # 0.10025469
    controller.update(current_kl=0.0, n_steps=10000)  # error -1 -> clipped to -0.2
    assert controller.value == pytest.approx(0.100512 * 0.99744 * 0.8)


def test_adaptive_controller_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


# ------------------------------------------------------------------------------------ properties

log_prob_pairs = batch_shapes.map(lambda shape: make_batch(*shape, log_ratio_scale=2.0))


@PROPERTY_SETTINGS
@given(batch=log_prob_pairs)
@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_estimators_vanish_at_equal_log_probs(name: str, batch) -> None:
    kl = KL_ESTIMATORS[name](batch.logp, batch.logp.clone())
    assert torch.equal(kl, torch.zeros_like(kl))


@PROPERTY_SETTINGS
@given(batch=log_prob_pairs)
@pytest.mark.parametrize("name", ["abs", "k2", "k3"])
def test_nonnegative_estimators(name: str, batch) -> None:
    assert (KL_ESTIMATORS[name](batch.logp, batch.ref_logp) >= 0).all()


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 6))
def test_full_kl_is_nonnegative_and_zero_at_equality(seed: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(3, 4, vocab, generator=generator, dtype=F64) * 3, dim=-1)
    ref = torch.log_softmax(torch.randn(3, 4, vocab, generator=generator, dtype=F64) * 3, dim=-1)
    assert (kl_full(logp, ref) >= -1e-12).all()
    torch.testing.assert_close(kl_full(logp, logp), torch.zeros(3, 4, dtype=F64), rtol=0, atol=1e-12)


@PROPERTY_SETTINGS
@given(shape=batch_shapes, estimator=st.sampled_from(["k1", "abs", "k2", "k3"]), mode=st.sampled_from(AGG_MODES))
def test_padding_never_leaks_into_kl(shape: tuple[int, int, int], estimator: str, mode: str) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)

    def run(logp: torch.Tensor, ref_logp: torch.Tensor):
        logp = logp.clone().requires_grad_()
        loss, metrics = kl_loss(logp, ref_logp, batch.mask, estimator=estimator, loss_agg_mode=mode, norm_horizon=9)
        loss.backward()
        rewards, reward_metrics = apply_kl_penalty(
            batch.scores, logp, ref_logp, batch.mask, kl_coef=0.2, estimator=estimator
        )
        return [loss, *metrics.values(), logp.grad, rewards, *reward_metrics.values()]

    clean = run(batch.logp, batch.ref_logp)
    for padding in (garbage_like(batch.logp, seed), torch.full_like(batch.logp, float("nan"))):
        dirty = run(with_padding(batch.logp, batch.mask, padding), with_padding(batch.ref_logp, batch.mask, -padding))
        for clean_output, dirty_output in zip(clean, dirty):
            assert torch.equal(dirty_output, clean_output)

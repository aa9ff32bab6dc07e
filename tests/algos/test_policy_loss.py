"""Policy losses (PPO, clip-higher, dual-clip, GSPO, CISPO), TIS weights and the entropy bonus, and the
properties every registered policy loss shares (shape checks, padding, clip fractions, ratio one)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from rlmega.algos import (
    POLICY_LOSSES,
    cispo_policy_loss,
    clip_higher_policy_loss,
    dual_clip_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
)

from .helpers import (
    AGG_MODES,
    ALL_POLICY_LOSSES,
    PPO_FAMILY,
    PROPERTY_SETTINGS,
    RATIO_CLIPPING_LOSSES,
    batch_shapes,
    garbage_like,
    make_batch,
    policy_loss_extras,
    reference_aggregate,
    with_padding,
)

F64 = torch.float64


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _log_ratios_case(ratios: list[float], advantages: list[float]):
    """One sequence with the given per-token ratios (old_logp = -1), plus one masked padding token."""
    old_logp = _tensor([[-1.0] * (len(ratios) + 1)])
    logp = (old_logp + _tensor([[math.log(r) for r in ratios] + [5.0]])).requires_grad_()
    adv = _tensor([advantages + [7.0]])
    mask = _tensor([[1.0] * len(ratios) + [0.0]])
    return logp, old_logp, adv, mask


# ---------------------------------------------------------------------------------------------- PPO


def test_ppo_by_hand() -> None:
    # ratio 1.25, A=+1: max(-1.25, -1.2) = -1.2   (clipped high, no gradient)
    # ratio 0.5,  A=-1: max(0.5, 0.8)    =  0.8   (clipped low, no gradient)
    # ratio 1.1,  A=-2: max(2.2, 2.2)    =  2.2   (inside the range)
    # ratio 0.7,  A=+2: max(-1.4, -1.6)  = -1.4   (below the range but A > 0: pessimistic term is unclipped)
    logp, old_logp, adv, mask = _log_ratios_case([1.25, 0.5, 1.1, 0.7], [1.0, -1.0, -2.0, 2.0])
    loss, metrics = ppo_policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 2.2 - 1.4) / 4, abs=1e-12)  # 0.1
    # d(-A r)/d logp = -A r on unclipped tokens, / 4 tokens
    torch.testing.assert_close(logp.grad, _tensor([[0.0, 0.0, 2 * 1.1 / 4, -2 * 0.7 / 4, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(0.25)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(0.25)
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(1.25 * 0.5 * 1.1 * 0.7) / 4, abs=1e-12)
    assert "pg_clipfrac_lower" not in metrics


def test_clip_higher_by_hand() -> None:
    # eps_high = 0.28: ratio 1.25 is now inside the range -> -1.25 with gradient -A r / 4 = -0.3125.
    logp, old_logp, adv, mask = _log_ratios_case([1.25, 0.5, 1.1, 0.7], [1.0, -1.0, -2.0, 2.0])
    loss, metrics = clip_higher_policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx((-1.25 + 0.8 + 2.2 - 1.4) / 4, abs=1e-12)  # 0.0875
    torch.testing.assert_close(logp.grad, _tensor([[-1.25 / 4, 0.0, 2.2 / 4, -1.4 / 4, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac_high"].item() == 0.0
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(0.25)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)


def test_ppo_asymmetric_ratios_explicitly() -> None:
    # eps_low = 0.1, eps_high = 0.5: ratio 0.85 with A=-1 is clipped at 0.9 -> loss 0.9;
    # ratio 1.4 with A=+1 is inside -> -1.4.
    logp, old_logp, adv, mask = _log_ratios_case([0.85, 1.4], [-1.0, 1.0])
    loss, metrics = ppo_policy_loss(logp, old_logp, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.5)
    assert loss.item() == pytest.approx((0.9 - 1.4) / 2, abs=1e-12)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_high"].item() == 0.0


def test_dual_clip_by_hand() -> None:
    # c = 3:
    # ratio 4,   A=-1: PPO max(4, 1.2) = 4, dual bound -A c = 3 -> 3 (dual-clipped, no gradient)
    # ratio 2,   A=-1: PPO 2 < 3                                -> 2 (gradient -A r / 4 = 0.5)
    # ratio 4,   A=+1: max(-4, -1.2) = -1.2 (clipped high; dual clip only acts on A < 0)
    # ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped low)
    logp, old_logp, adv, mask = _log_ratios_case([4.0, 2.0, 4.0, 0.5], [-1.0, -1.0, 1.0, -1.0])
    loss, metrics = dual_clip_policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx((3 + 2 - 1.2 + 0.8) / 4, abs=1e-12)  # 1.15
    torch.testing.assert_close(logp.grad, _tensor([[0.0, 0.5, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


def test_vanilla_is_plain_ppo_without_dual_clip() -> None:
    logp, old_logp, adv, mask = _log_ratios_case([4.0], [-1.0])
    loss, metrics = POLICY_LOSSES["vanilla"](logp, old_logp, adv, mask)
    assert loss.item() == pytest.approx(4.0)  # -A r, unbounded without dual clip
    assert "pg_clipfrac_lower" not in metrics


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
    ],
)
def test_ppo_rejects_bad_clip_ratios(kwargs: dict, message: str) -> None:
    logp, old_logp, adv, mask = _log_ratios_case([1.0], [1.0])
    with pytest.raises(ValueError, match=message):
        ppo_policy_loss(logp, old_logp, adv, mask, **kwargs)


# --------------------------------------------------------------------------------------------- GSPO

# Sequence 0: 2 valid tokens, log ratios 0.1, 0.3 -> s0 = exp(0.2); sequence 1: 3 valid tokens,
# log ratios -0.3, 0, 0 -> s1 = exp(-0.1); one padding token each (garbage values). A = +1.
GSPO_OLD = _tensor([[-1.0, -2.0, -1.0, 0.0], [-0.5, -1.5, -2.5, 0.0]])
GSPO_LOG_RATIO = _tensor([[0.1, 0.3, 9.0, 9.0], [-0.3, 0.0, 0.0, 9.0]])
GSPO_MASK = _tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
GSPO_ADV = _tensor([[1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 1.0, 3.0]])


def test_gspo_by_hand_with_paper_clip_range() -> None:
    logp = (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()
    loss, metrics = gspo_policy_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK)
    loss.backward()
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    # s0 = 1.2214 > 1 + 4e-4 with A > 0: clipped to 1.0004 (no gradient); s1 = 0.9048 < 1: unclipped.
    assert loss.item() == pytest.approx((-1.0004 + -s1) / 2, abs=1e-12)  # seq-mean-token-mean
    # d/dlogp_t of (1/2) * (1/3) * sum_t -s1_t  =  -s1 / 6 for each valid token of sequence 1
    expected_grad = _tensor([[0.0, 0.0, 0.0, 0.0], [-s1 / 6, -s1 / 6, -s1 / 6, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)  # the 2 tokens of sequence 0
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(2 / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-(0.1 + 0.3 - 0.3) / 5, abs=1e-12)
    assert s0 > 1.0004


def test_gspo_gradient_is_sequence_level_when_unclipped() -> None:
    # Wide clip range: nothing clipped. GSPO's gradient of -(1/G) sum_i A_i s_i is
    # -(1/G) A_i s_i (1/n_i) sum_t grad logp_it, i.e. -s_i / (2 n_i) per valid token.
    logp = (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()
    loss, metrics = gspo_policy_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK, clip_ratio_low=0.5, clip_ratio_high=0.5)
    loss.backward()
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    assert loss.item() == pytest.approx(-(s0 + s1) / 2, abs=1e-12)
    expected_grad = _tensor([[-s0 / 4, -s0 / 4, 0.0, 0.0], [-s1 / 6, -s1 / 6, -s1 / 6, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_gspo_token_mean_weights_tokens() -> None:
    logp = (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()
    loss, _ = gspo_policy_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK, loss_agg_mode="token-mean")
    # 2 tokens at -1.0004 and 3 tokens at -s1, over 5 tokens
    assert loss.item() == pytest.approx((2 * -1.0004 + 3 * -math.exp(-0.1)) / 5, abs=1e-12)


# -------------------------------------------------------------------------------------------- CISPO


def test_cispo_by_hand_without_lower_bound() -> None:
    # weights = sg(clip(r, max=1.28)): r = 1.5 -> 1.28, 0.5 -> 0.5 (no lower bound), 1.1 -> 1.1.
    # loss_t = -A w: -1.28, +0.5, -2.2 ; every token keeps gradient -A w / 3.
    logp, old_logp, adv, mask = _log_ratios_case([1.5, 0.5, 1.1], [1.0, -1.0, 2.0])
    loss, metrics = cispo_policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx((-1.28 + 0.5 - 2.2) / 3, abs=1e-12)
    torch.testing.assert_close(logp.grad, _tensor([[-1.28 / 3, 0.5 / 3, -2.2 / 3, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(1 / 3)
    assert metrics["pg_clipfrac_low"].item() == 0.0


def test_cispo_with_lower_bound() -> None:
    # clip_ratio_low = 0.2: r = 0.5 -> w = 0.8, loss +0.8, gradient 0.8 / 3 (still nonzero).
    logp, old_logp, adv, mask = _log_ratios_case([1.5, 0.5, 1.1], [1.0, -1.0, 2.0])
    loss, metrics = cispo_policy_loss(logp, old_logp, adv, mask, clip_ratio_low=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2) / 3, abs=1e-12)
    torch.testing.assert_close(logp.grad, _tensor([[-1.28 / 3, 0.8 / 3, -2.2 / 3, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(1 / 3)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------- TIS


def test_entropy_from_logits_by_hand() -> None:
    # uniform over 4 -> ln 4; probabilities (0.25, 0.75) -> -(0.25 ln 0.25 + 0.75 ln 0.75)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]], dtype=F64)
    expected = _tensor([[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    torch.testing.assert_close(entropy_from_logits(logits), expected, rtol=0, atol=1e-12)


def test_entropy_bonus_by_hand() -> None:
    entropy = _tensor([[1.0, 2.0], [3.0, 100.0]]).requires_grad_()
    mask = _tensor([[1, 1], [1, 0]])
    loss, metrics = entropy_bonus(entropy, mask, coef=0.01)
    loss.backward()
    assert loss.item() == pytest.approx(-0.01 * (1 + 2 + 3) / 3, abs=1e-12)  # -0.02
    assert metrics["entropy"].item() == pytest.approx(2.0)
    torch.testing.assert_close(entropy.grad, _tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]))


# ------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("loss_name", ALL_POLICY_LOSSES)
def test_shape_mismatch_names_the_shapes(loss_name: str) -> None:
    ok = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"advantages \[2, 4\]"):
        POLICY_LOSSES[loss_name](ok, ok, torch.zeros(2, 4, dtype=F64), ok)
    with pytest.raises(ValueError, match=r"rollout_is_weights \[3\]"):
        POLICY_LOSSES[loss_name](ok, ok, ok, ok, rollout_is_weights=torch.ones(3))


# --------------------------------------------------------------------------------------- properties


# At ratio 1 these losses equal -A, aggregated. The others differ by design: REINFORCE/GPG is
# -A logp, SAPO's gate is 2/tau at ratio 1, Clip-Cov removes tokens (each has its own test).
RATIO_ONE_IS_MINUS_ADVANTAGE = [*PPO_FAMILY, "geo_mean", "kl_cov"]


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", RATIO_ONE_IS_MINUS_ADVANTAGE)
def test_ratio_one_gives_minus_advantage_aggregated(loss_name: str, mode: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    logp = batch.old_logp.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES[loss_name](
        logp, batch.old_logp, batch.advantages, batch.mask, loss_agg_mode=mode, norm_horizon=num_tokens
    )
    expected = reference_aggregate(-batch.advantages, batch.mask, mode, num_tokens)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["ppo_kl"].item() == 0.0
    assert metrics.get("pg_clipfrac", torch.zeros(())).item() == 0.0


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("loss_name", RATIO_CLIPPING_LOSSES)
def test_clip_fractions_are_fractions(loss_name: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens, log_ratio_scale=2.0)
    _, metrics = POLICY_LOSSES[loss_name](
        batch.logp, batch.old_logp, batch.advantages, batch.mask, **policy_loss_extras(loss_name, seed)
    )
    clip_fractions = {name: value.item() for name, value in metrics.items() if "clipfrac" in name}
    assert {"pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low"} <= clip_fractions.keys()
    assert all(0.0 <= value <= 1.0 for value in clip_fractions.values())
    # the high and low bounds are exclusive events, so their fractions add up
    total = clip_fractions["pg_clipfrac_high"] + clip_fractions["pg_clipfrac_low"]
    assert clip_fractions["pg_clipfrac"] == pytest.approx(total)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", ALL_POLICY_LOSSES)
def test_padding_never_leaks_into_policy_losses(loss_name: str, mode: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    weights = torch.rand(batch_size, num_tokens, dtype=F64, generator=torch.Generator().manual_seed(seed))

    def run(logp, old_logp, advantages, rollout_is_weights):
        logp = logp.clone().requires_grad_()
        loss, metrics = POLICY_LOSSES[loss_name](
            logp,
            old_logp,
            advantages,
            batch.mask,
            loss_agg_mode=mode,
            norm_horizon=num_tokens,
            rollout_is_weights=rollout_is_weights,
            **policy_loss_extras(loss_name, seed),
        )
        loss.backward()
        return loss, metrics, logp.grad

    clean = run(batch.logp, batch.old_logp, batch.advantages, weights)
    nan = torch.full_like(batch.logp, float("nan"))
    for padding in (garbage_like(batch.logp, seed), nan):
        inputs = (batch.logp, batch.old_logp, batch.advantages, weights)
        dirty = run(*(with_padding(x, batch.mask, padding) for x in inputs))
        assert dirty[0].item() == clean[0].item()
        assert {k: v.item() for k, v in dirty[1].items()} == {k: v.item() for k, v in clean[1].items()}
        assert torch.equal(dirty[2], clean[2])
        assert torch.equal(dirty[2][batch.mask == 0], torch.zeros(int((batch.mask == 0).sum()), dtype=F64))


def test_entropy_from_logits_gradient_is_finite_with_masked_vocabulary() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf]]], dtype=F64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    # dH/dz_v = -p_v (log p_v + H); for p = (0.25, 0.75, 0): H = 0.5623
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = [-0.25 * (math.log(0.25) + entropy), -0.75 * (math.log(0.75) + entropy), 0.0]
    torch.testing.assert_close(logits.grad, torch.tensor([[expected]], dtype=F64), rtol=0, atol=1e-12)

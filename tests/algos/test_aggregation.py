"""Loss aggregation modes, denominators, and invariance under micro-batch / data-parallel splits."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmega.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossDenominators,
    aggregate_loss,
    count_loss_denominators,
    entropy_bonus,
    kl_loss,
)

from .helpers import (
    AGG_MODES,
    ALL_POLICY_LOSSES,
    PER_CALL_SELECTION,
    PROPERTY_SETTINGS,
    batch_shapes,
    garbage_like,
    make_batch,
    reference_aggregate,
    split_rows,
    trimmed_width,
    with_padding,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
# Row 0: tokens 1, 2 valid; row 1: token 4 valid; row 2: fully masked (e.g. overlong-filtered).
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)


def test_registry_lists_exactly_the_four_modes() -> None:
    assert sorted(LOSS_AGG_MODES) == sorted(AGG_MODES)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 3 valid tokens
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # 2 non-empty sequences; the empty row is not counted
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),  # = 2.75
        ("seq-mean-token-sum-norm", ((1 + 2) + 4) / (2 * 4)),  # horizon 4 -> 0.875
    ],
)
def test_local_denominators_by_hand(mode: str, expected: float) -> None:
    result = aggregate_loss(VALUES, MASK, mode, norm_horizon=4)
    assert result.dim() == 0
    assert result.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 10),  # local sum 7 over 10 global tokens
        ("seq-mean-token-sum", 7 / 5),  # over 5 global sequences
        ("seq-mean-token-mean", (1.5 + 4) / 5),  # per-sequence means stay local
        ("seq-mean-token-sum-norm", 7 / (5 * 4)),
    ],
)
def test_global_denominators_by_hand(mode: str, expected: float) -> None:
    denominators = LossDenominators(num_tokens=torch.tensor(10), num_seqs=torch.tensor(5))
    result = aggregate_loss(VALUES, MASK, mode, global_denominators=denominators, norm_horizon=4)
    assert result.item() == pytest.approx(expected, abs=1e-12)


def test_global_denominators_accept_python_numbers() -> None:
    result = aggregate_loss(VALUES, MASK, "token-mean", global_denominators=LossDenominators(10, 5))
    assert result.item() == pytest.approx(0.7, abs=1e-12)


def test_count_loss_denominators_by_hand() -> None:
    counts = count_loss_denominators(MASK.bool())
    assert counts.num_tokens.item() == 3  # 2 + 1 + 0
    assert counts.num_seqs.item() == 2  # the fully masked row does not count
    assert counts.num_tokens.dtype == torch.int64


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_gives_zero_not_nan(mode: str) -> None:
    values = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    result = aggregate_loss(values, torch.zeros(2, 3), mode, norm_horizon=3)
    result.backward()
    assert result.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_padding_values_including_nan_do_not_leak(mode: str) -> None:
    padded = VALUES.clone().requires_grad_()
    poisoned = with_padding(VALUES, MASK, torch.full_like(VALUES, float("nan"))).requires_grad_()
    clean_result = aggregate_loss(padded, MASK, mode, norm_horizon=4)
    poisoned_result = aggregate_loss(poisoned, MASK, mode, norm_horizon=4)
    clean_result.backward()
    poisoned_result.backward()
    assert poisoned_result.item() == clean_result.item()
    assert torch.equal(poisoned.grad, padded.grad)
    assert torch.equal(poisoned.grad[~MASK.bool()], torch.zeros(6, dtype=torch.float64))  # 6 masked entries


def test_gradient_by_hand_seq_mean_token_mean() -> None:
    values = VALUES.clone().requires_grad_()
    aggregate_loss(values, MASK, "seq-mean-token-mean").backward()
    # d/dx of ((x00 + x01)/2 + x10/1) / 2
    expected = torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(values.grad, expected, rtol=0, atol=1e-12)


def test_norm_mode_requires_horizon() -> None:
    with pytest.raises(ValueError, match="norm_horizon"):
        aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm")


def test_unknown_mode_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-mean") as error:
        aggregate_loss(VALUES, MASK, "sum")
    assert "'sum'" in str(error.value)


def test_shape_mismatch_names_shapes() -> None:
    with pytest.raises(ValueError, match=r"values \[3, 3\].*response_mask \[3, 2\]"):
        aggregate_loss(VALUES, MASK[:, :2])
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        count_loss_denominators(MASK[0])


LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor, str, Optional[LossDenominators], int], torch.Tensor]


def _split_matches_full_batch(
    loss_fn: LossFn, inputs: dict[str, torch.Tensor], mask: torch.Tensor, mode: str, seed: int, horizon: int
) -> None:
    """Loss and summed gradients over (rank x micro-batch) pieces equal the full-batch ones.

    ``loss_fn(inputs, mask, mode, global_denominators, horizon)``; ``inputs["logp"]`` is the
    tensor differentiated. Pieces are random row subsets, each trimmed to its own padded width.
    """
    batch_size = mask.shape[0]
    full_logp = inputs["logp"].clone().requires_grad_()
    full_loss = loss_fn({**inputs, "logp": full_logp}, mask, mode, None, horizon)
    full_loss.backward()

    num_ranks, num_micro_batches = 1 + seed % 3, 1 + (seed // 3) % 3
    pieces = [
        (rows, trimmed_width(mask[rows])) for rows in split_rows(seed, batch_size, num_ranks * num_micro_batches)
    ]
    per_piece_counts = [torch.stack(count_loss_denominators(mask[rows, :width])) for rows, width in pieces]
    global_denominators = LossDenominators(*torch.stack(per_piece_counts).sum(dim=0))  # the "all-reduce"

    split_logp = inputs["logp"].clone().requires_grad_()
    summed_loss = torch.zeros((), dtype=torch.float64)
    for rows, width in pieces:
        piece = {name: tensor[rows, :width] for name, tensor in inputs.items()}
        piece["logp"] = split_logp[rows, :width]
        piece_loss = loss_fn(piece, mask[rows, :width], mode, global_denominators, horizon)
        piece_loss.backward()  # gradients accumulate in split_logp.grad, as across micro-batches and ranks
        summed_loss = summed_loss + piece_loss.detach()

    torch.testing.assert_close(summed_loss, full_loss.detach(), rtol=0, atol=1e-9)
    torch.testing.assert_close(split_logp.grad, full_logp.grad, rtol=0, atol=1e-6)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_plain_aggregation_is_split_invariant(mode: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)

    def nonlinear_loss(inputs, mask, mode, global_denominators, horizon):
        logp = inputs["logp"]
        return aggregate_loss(
            torch.sin(logp) * logp, mask, mode, global_denominators=global_denominators, norm_horizon=horizon
        )

    _split_matches_full_batch(nonlinear_loss, {"logp": batch.logp}, batch.mask, mode, seed, num_tokens)


SPLIT_INVARIANT_LOSSES = [name for name in ALL_POLICY_LOSSES if name not in PER_CALL_SELECTION]
# With these settings Clip-Cov and KL-Cov select nothing that changes the loss: no covariance lies in
# Clip-Cov's window, and KL-Cov's penalty has coefficient 0.
NO_SELECTION = {"clip_cov": {"clip_cov_lb": 1e9, "clip_cov_ub": 2e9}, "kl_cov": {"ppo_kl_coef": 0.0}}


def test_every_policy_loss_is_checked_for_split_invariance() -> None:
    assert sorted(ALL_POLICY_LOSSES) == sorted(POLICY_LOSSES)
    assert sorted(NO_SELECTION) == sorted(PER_CALL_SELECTION)


def _policy_loss_fn(loss_name: str, **loss_kwargs) -> LossFn:
    def policy_loss(inputs, mask, mode, global_denominators, horizon):
        loss, _ = POLICY_LOSSES[loss_name](
            inputs["logp"],
            inputs["old_logp"],
            inputs["advantages"],
            mask,
            loss_agg_mode=mode,
            global_denominators=global_denominators,
            norm_horizon=horizon,
            rollout_is_weights=inputs["weights"],
            **loss_kwargs,
        )
        return loss

    return policy_loss


def _policy_inputs(seed: int, batch_size: int, num_tokens: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    batch = make_batch(seed, batch_size, num_tokens, log_ratio_scale=0.3)
    weights = torch.rand(batch_size, num_tokens, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    inputs = {"logp": batch.logp, "old_logp": batch.old_logp, "advantages": batch.advantages, "weights": weights}
    return inputs, batch.mask


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", SPLIT_INVARIANT_LOSSES)
def test_policy_losses_are_split_invariant(loss_name: str, mode: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    inputs, mask = _policy_inputs(seed, batch_size, num_tokens)
    _split_matches_full_batch(_policy_loss_fn(loss_name), inputs, mask, mode, seed, num_tokens)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", PER_CALL_SELECTION)
def test_covariance_losses_keep_the_denominator_contract_without_selection(
    loss_name: str, mode: str, shape: tuple[int, int, int]
) -> None:
    seed, batch_size, num_tokens = shape
    inputs, mask = _policy_inputs(seed, batch_size, num_tokens)
    loss_fn = _policy_loss_fn(loss_name, **NO_SELECTION[loss_name])
    _split_matches_full_batch(loss_fn, inputs, mask, mode, seed, num_tokens)


@pytest.mark.parametrize("loss_name", PER_CALL_SELECTION)
def test_covariance_losses_select_per_call(loss_name: str) -> None:
    # Two identical rows, 3 tokens each. Per row (and over both) the covariance is (2, 2, 0):
    # A = (2, -2, 0) has mean 0, logp = (-1, -3, -2) has mean -2. Each call treats at least one
    # token (k = max(1, floor(2e-4 * N))), so two one-row calls treat two tokens, one call over
    # both rows treats one: the split changes the loss.
    logp = torch.tensor([[-1.0, -3.0, -2.0]] * 2, dtype=torch.float64)
    old_logp = logp - 0.1  # ratio e^0.1 < 1.2: PPO clips nothing; KL-Cov's penalty is 0.1 per token
    advantages = torch.tensor([[2.0, -2.0, 0.0]] * 2, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    loss_kwargs = {"ppo_kl_coef": 1.0} if loss_name == "kl_cov" else {}
    denominators = count_loss_denominators(mask)
    frac_name = f"{loss_name}_frac"

    def call(rows: slice, seed: int):
        extras = {"generator": torch.Generator().manual_seed(seed)} if loss_name == "clip_cov" else {}
        return POLICY_LOSSES[loss_name](
            logp[rows], old_logp[rows], advantages[rows], mask[rows],
            global_denominators=denominators, **loss_kwargs, **extras,
        )

    full_loss, full_metrics = call(slice(0, 2), 0)
    (first_loss, first_metrics), (second_loss, second_metrics) = call(slice(0, 1), 1), call(slice(1, 2), 2)
    assert full_metrics[frac_name].item() * 6 == pytest.approx(1.0)
    assert first_metrics[frac_name].item() * 3 == pytest.approx(1.0)
    assert second_metrics[frac_name].item() * 3 == pytest.approx(1.0)
    # One more token treated: Clip-Cov drops another -A r = -2 e^0.1 or +2 e^0.1, KL-Cov adds 0.1.
    assert (first_loss + second_loss).item() != pytest.approx(full_loss.item(), abs=1e-6)


@PROPERTY_SETTINGS
@given(shape=batch_shapes, estimator=st.sampled_from(["k1", "abs", "k2", "k3"]))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_loss_and_entropy_bonus_are_split_invariant(mode: str, shape: tuple[int, int, int], estimator: str) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)

    def kl_plus_entropy(inputs, mask, mode, global_denominators, horizon):
        logp = inputs["logp"]
        aggregation = dict(loss_agg_mode=mode, global_denominators=global_denominators, norm_horizon=horizon)
        kl_term, _ = kl_loss(logp, inputs["ref_logp"], mask, coef=0.3, estimator=estimator, **aggregation)
        # -logp * exp(logp) stands in for a per-token entropy that depends on logp.
        entropy_term, _ = entropy_bonus(-logp * torch.exp(logp), mask, coef=0.01, **aggregation)
        return kl_term + entropy_term

    inputs = {"logp": batch.logp, "ref_logp": batch.ref_logp}
    _split_matches_full_batch(kl_plus_entropy, inputs, batch.mask, mode, seed, num_tokens)


@PROPERTY_SETTINGS
@given(shape=batch_shapes)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_loop_reference(mode: str, shape: tuple[int, int, int]) -> None:
    seed, batch_size, num_tokens = shape
    batch = make_batch(seed, batch_size, num_tokens)
    values = with_padding(batch.values, batch.mask, garbage_like(batch.values, seed))
    result = aggregate_loss(values, batch.mask, mode, norm_horizon=num_tokens + 1)
    expected = reference_aggregate(batch.values, batch.mask, mode, num_tokens + 1)
    assert result.item() == pytest.approx(expected, abs=1e-9)

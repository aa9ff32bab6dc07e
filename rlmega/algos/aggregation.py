"""Turning a ``[B, T]`` matrix of per-token losses into one scalar.

Contract for data-parallel ranks and micro-batches
--------------------------------------------------
A global batch is split over DP ranks and, on each rank, over gradient-accumulation
micro-batches. Every mode below divides a *sum* by a denominator (number of valid tokens, or
number of sequences that have at least one valid token). If each piece divided by its own local
denominator, the sum of the pieces' gradients would weight tokens differently from one big batch.
So the caller computes the denominators once for the whole global batch and passes them in::

    local = count_loss_denominators(mask_of_all_my_micro_batches)   # on every rank
    counts = torch.stack(local)                                     # [num_tokens, num_seqs]
    torch.distributed.all_reduce(counts, group=dp_group)            # SUM over DP ranks
    global_denominators = LossDenominators(*counts.unbind())
    for micro_batch in my_micro_batches:
        loss = aggregate_loss(per_token, micro_batch.mask, mode,
                              global_denominators=global_denominators, norm_horizon=max_response_length)
        loss.backward()                                             # gradients accumulate (sum)

Then ``sum over ranks and micro-batches of loss`` equals the loss of the whole global batch, and so
do the gradients. The sum is what must be reproduced: if the DP gradient reduction *averages* over
ranks (Megatron's default), multiply each local loss by the DP world size to cancel it.
Without ``global_denominators`` the local counts are used, i.e. the call is treated as the whole
batch.

A sequence is never split across micro-batches, so per-sequence token counts
(``seq-mean-token-mean``) are always local.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from rlmega.algos._utils import check_response_mask, check_same_shape, lookup, zero_masked


class LossDenominators(NamedTuple):
    """Denominators of the loss aggregation, 0-dim int64 tensors.

    ``num_tokens``: number of valid tokens. ``num_seqs``: number of sequences with at least one
    valid token (fully masked sequences, e.g. overlong-filtered ones, are not counted).
    """

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor


def count_loss_denominators(response_mask: torch.Tensor) -> LossDenominators:
    """Local denominators of a ``[B, T]`` response mask; sum them over micro-batches and DP ranks.

    Integer counts, so that the all-reduce is exact at any batch size.
    """
    mask = check_response_mask(response_mask)
    return LossDenominators(
        num_tokens=mask.sum(),
        num_seqs=mask.any(dim=-1).sum(),
    )


AggregationMode = Callable[[torch.Tensor, torch.Tensor, LossDenominators, Optional[float]], torch.Tensor]


def _token_mean(
    masked_values: torch.Tensor, mask: torch.Tensor, denominators: LossDenominators, norm_horizon: Optional[float]
) -> torch.Tensor:
    """``sum_{i,t} m_it x_it / N_tokens``: every token weighs the same (DAPO token-level loss)."""
    return masked_values.sum() / denominators.num_tokens.clamp(min=1)


def _seq_mean_token_sum(
    masked_values: torch.Tensor, mask: torch.Tensor, denominators: LossDenominators, norm_horizon: Optional[float]
) -> torch.Tensor:
    """``sum_i (sum_t m_it x_it) / N_seqs``: long sequences weigh more."""
    return masked_values.sum() / denominators.num_seqs.clamp(min=1)


def _seq_mean_token_mean(
    masked_values: torch.Tensor, mask: torch.Tensor, denominators: LossDenominators, norm_horizon: Optional[float]
) -> torch.Tensor:
    """``sum_i (sum_t m_it x_it / n_i) / N_seqs`` with ``n_i`` the valid tokens of sequence i (original GRPO)."""
    per_sequence = masked_values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_sequence.sum() / denominators.num_seqs.clamp(min=1)


def _seq_mean_token_sum_norm(
    masked_values: torch.Tensor, mask: torch.Tensor, denominators: LossDenominators, norm_horizon: Optional[float]
) -> torch.Tensor:
    """``sum_i (sum_t m_it x_it) / (N_seqs * H)`` with a constant horizon H (Dr. GRPO)."""
    if norm_horizon is None or norm_horizon <= 0:
        raise ValueError(
            "loss aggregation mode 'seq-mean-token-sum-norm' needs a positive norm_horizon "
            f"(e.g. the max response length), got {norm_horizon!r}"
        )
    return masked_values.sum() / (denominators.num_seqs.clamp(min=1) * norm_horizon)


LOSS_AGG_MODES: dict[str, AggregationMode] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(
    values: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate per-token values ``[B, T]`` over valid tokens into a 0-dim tensor.

    With ``m`` the mask, ``n_i = sum_t m_it``, ``N_tokens`` / ``N_seqs`` the (global) denominators:

    - ``token-mean``: ``sum_{i,t} m_it x_it / N_tokens`` (DAPO, Yu et al. 2025).
    - ``seq-mean-token-sum``: ``sum_i sum_t m_it x_it / N_seqs``.
    - ``seq-mean-token-mean``: ``sum_i (sum_t m_it x_it / n_i) / N_seqs`` (GRPO, Shao et al. 2024).
    - ``seq-mean-token-sum-norm``: ``sum_i sum_t m_it x_it / (N_seqs * norm_horizon)``
      (Dr. GRPO, Liu et al. 2025; ``norm_horizon`` is a constant such as the max response length).

    Args:
        values: ``[B, T]`` per-token values (differentiable).
        response_mask: ``[B, T]``, nonzero on valid tokens. Masked entries never affect the result.
        mode: one of ``LOSS_AGG_MODES``.
        global_denominators: denominators of the whole global batch (see the module docstring);
            ``None`` uses this call's own counts.
        norm_horizon: the constant H of ``seq-mean-token-sum-norm``; required by that mode only.

    Returns:
        0-dim tensor; summing it over the micro-batches and ranks that share ``global_denominators``
        gives the full-batch value.
    """
    mode_fn = lookup(LOSS_AGG_MODES, mode, "loss aggregation mode")
    check_same_shape(values=values, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    denominators = global_denominators if global_denominators is not None else count_loss_denominators(mask)
    denominators = LossDenominators(*(torch.as_tensor(count, device=values.device) for count in denominators))
    return mode_fn(zero_masked(values, mask), mask, denominators, norm_horizon)

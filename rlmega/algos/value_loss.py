"""The critic's loss: clipped squared error of values against returns (PPO, Schulman et al. 2017)."""

from __future__ import annotations

from typing import Optional

import torch

from rlmega.algos._utils import check_response_mask, check_same_shape, masked_mean, zero_masked
from rlmega.algos.aggregation import LossDenominators, aggregate_loss


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: Optional[float] = 0.5,
    loss_agg_mode: str = "token-mean",
    global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, aggregated.

    Clipping keeps the critic from moving far from the values the advantages were computed with;
    ``cliprange_value=None`` gives the plain squared error.

    Args:
        values: ``[B, T]`` current values (differentiable). old_values, returns, response_mask: ``[B, T]``.
        cliprange_value: the clip range ``c`` or None.
        loss_agg_mode, global_denominators, norm_horizon: passed to ``aggregate_loss``.

    Returns:
        ``(loss, metrics)`` with ``vf_clipfrac`` (share of tokens where the clipped error was larger)
        and ``vpred_mean``, over this call's valid tokens.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    if cliprange_value is not None and cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be positive or None, got {cliprange_value}")
    old_values, returns = zero_masked(old_values.detach(), mask), zero_masked(returns.detach(), mask)
    values = zero_masked(values, mask)
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        per_token, clipped_more = unclipped, torch.zeros_like(mask, dtype=values.dtype)
    else:
        clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped_error = (clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped_error)
        clipped_more = (clipped_error > unclipped).to(values.dtype)
    loss = 0.5 * aggregate_loss(
        per_token, mask, loss_agg_mode, global_denominators=global_denominators, norm_horizon=norm_horizon
    )
    metrics = {"vf_clipfrac": masked_mean(clipped_more, mask), "vpred_mean": masked_mean(values, mask)}
    return loss, {name: value.detach() for name, value in metrics.items()}

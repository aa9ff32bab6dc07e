"""DAPO data-side pieces (Yu et al. 2025, arXiv:2503.14476): dynamic sampling, overlong shaping and filtering.

The policy-side DAPO pieces live elsewhere: clip-higher is ``policy_loss.clip_higher_policy_loss``
and the token-level loss is the ``token-mean`` aggregation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlmega.algos._utils import GroupIds, as_float, check_response_mask, group_index


class DynamicSamplingResult(NamedTuple):
    """Outcome of ``dynamic_sampling_filter``.

    ``keep_mask [B]`` bool; ``kept_indices [K]`` long, ascending (``batch[kept_indices]``);
    ``num_kept_groups`` / ``num_dropped_groups``: number of prompt groups kept / dropped.
    """

    keep_mask: torch.Tensor
    kept_indices: torch.Tensor
    num_kept_groups: int
    num_dropped_groups: int


def dynamic_sampling_filter(group_ids: GroupIds, metric: torch.Tensor) -> DynamicSamplingResult:
    """DAPO dynamic sampling: keep only prompt groups whose metric is not constant, and groups of one.

    A group whose samples all have the same metric (e.g. accuracy all 0 or all 1) has zero
    variance, hence zero GRPO advantage and no gradient; it only dilutes the batch. A group of one
    sample is kept, as verl keeps it (``std > 0 or len == 1``; rlmega's trainer never forms one, as
    dynamic sampling needs ``rollout.n`` > 1). "Not constant" is tested exactly (max > min), so
    rounding cannot turn a constant group into a kept one.

    The function is pure. The trainer is expected to loop: generate a batch, filter, append the
    kept groups to a buffer, and generate again until the buffer holds the target number of
    prompts or ``max_num_gen_batches`` generation rounds were used (then train on what it has, or
    fail, by configuration), and finally trim the buffer to the target size.

    Args:
        group_ids: ``[B]`` prompt uids (int tensor or iterable of hashables), any order.
        metric: ``[B]`` per-sample metric (``acc``, ``score`` ...).

    Returns:
        ``DynamicSamplingResult``.
    """
    if metric.dim() != 1:
        raise ValueError(f"metric must be [B], got shape {list(metric.shape)}")
    metric = as_float(metric)
    index, num_groups = group_index(group_ids, metric.shape[0], metric.device)
    group_max = torch.full((num_groups,), -torch.inf, dtype=metric.dtype, device=metric.device)
    group_min = torch.full((num_groups,), torch.inf, dtype=metric.dtype, device=metric.device)
    group_max = group_max.scatter_reduce(0, index, metric, reduce="amax")
    group_min = group_min.scatter_reduce(0, index, metric, reduce="amin")
    group_sizes = torch.zeros(num_groups, dtype=torch.long, device=metric.device).index_add_(
        0, index, torch.ones_like(index))
    kept_groups = (group_max > group_min) | (group_sizes == 1)
    keep_mask = kept_groups[index]
    num_kept_groups = int(kept_groups.sum())
    return DynamicSamplingResult(
        keep_mask=keep_mask,
        kept_indices=keep_mask.nonzero().squeeze(-1),
        num_kept_groups=num_kept_groups,
        num_dropped_groups=num_groups - num_kept_groups,
    )


def overlong_reward_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the score. ``L_max = max_response_length``,
    ``L_cache = overlong_buffer_length``:

        0                                                  if len <= L_max - L_cache
        (L_max - L_cache - len) / L_cache * penalty_factor if L_max - L_cache < len <= L_max
        -penalty_factor                                    if len > L_max

    Shapes: ``response_lengths [B]`` (valid response tokens, e.g. ``response_mask.sum(-1)``) ->
    ``[B]`` float penalties in ``[-penalty_factor, 0]``. The paper uses L_max = 20480,
    L_cache = 4096, penalty_factor = 1.
    """
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be [B], got shape {list(response_lengths.shape)}")
    if not 0 < overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"need 0 < overlong_buffer_length <= max_response_length, got {overlong_buffer_length} "
            f"and {max_response_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = as_float(response_lengths)
    excess = lengths - (max_response_length - overlong_buffer_length)
    # Linear in the buffer; the clamp gives 0 before it and -penalty_factor past L_max.
    return (-excess / overlong_buffer_length * penalty_factor).clamp(min=-penalty_factor, max=0.0)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: drop truncated samples from the loss by zeroing their mask rows.

    A truncated response (the engine stopped it at the length limit, ``finish_reason == "length"``,
    or equivalently ``length >= max_response_length``) has no real ending, so its reward is noise.
    Zeroed rows count neither as tokens nor as sequences in the loss denominators.

    Shapes: ``response_mask [B, T]``, ``truncated [B]`` bool -> mask ``[B, T]`` of the input dtype.
    """
    check_response_mask(response_mask)
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"truncated must be [B] for response_mask {list(response_mask.shape)}, got {list(truncated.shape)}"
        )
    return torch.where(truncated.bool().unsqueeze(-1), torch.zeros_like(response_mask), response_mask)

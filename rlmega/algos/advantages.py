"""Advantage estimators.

Every estimator returns ``(advantages, returns)``, both ``[B, T]``, 0 on masked tokens, computed
under ``torch.no_grad`` (they are regression/weighting targets, never differentiated through).

Inputs, named the same way everywhere (each estimator takes only what it needs):

- ``token_level_rewards [B, T]``: per-token rewards (e.g. the outcome score at the last valid token
  minus a KL penalty, see ``rlmega.algos.kl.apply_kl_penalty``).
- ``scores [B]``: one outcome score per sequence (verifier / reward model).
- ``values [B, T]``: critic values of the state before each response token.
- ``response_mask [B, T]``: nonzero on valid response tokens. Holes are allowed (e.g. masked
  tool/environment tokens in multi-turn rollouts); recursions skip them.
- ``group_ids [B]``: prompt uid of every sample (int tensor or any iterable of hashables); samples
  of a group may sit anywhere in the batch and groups may have different sizes.

For outcome estimators ``returns`` is the undiscounted reward-to-go, i.e. the score broadcast over
valid tokens (verl returns the advantages a second time instead; nothing critic-free reads it).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlmega.algos._utils import (
    GroupIds,
    as_float,
    broadcast_to_tokens,
    check_response_mask,
    check_same_shape,
    check_sequence_values,
    group_index,
    group_sum,
    zero_masked,
)


def masked_whiten(values: torch.Tensor, response_mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """Batch whitening over valid tokens: ``(x - mean) / sqrt(var + epsilon)``, 0 on masked tokens.

    Mean and (population, i.e. biased) variance are taken over all valid tokens of the batch, so
    the whitened valid entries have mean 0 and variance ``var / (var + epsilon)``. Shapes: ``[B, T]``.
    (verl uses the Bessel-corrected variance; the difference is a factor ``sqrt((N-1)/N)``.)
    """
    check_same_shape(values=values, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    count = mask.sum().clamp(min=1)
    mean = zero_masked(values, mask).sum() / count
    centered = zero_masked(values - mean, mask)
    variance = centered.square().sum() / count
    return centered * torch.rsqrt(variance + epsilon)


def place_scores_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``[B, T]``: ``scores [B]`` at the last valid token of each row, 0 elsewhere.

    "Last valid" is the highest index with a nonzero mask, so masks with holes work. A row without
    valid tokens gets no reward.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    num_columns = mask.shape[-1]
    positions = torch.arange(num_columns, device=mask.device).expand(mask.shape)
    last_index = torch.where(mask, positions, -1).amax(dim=-1, keepdim=True)
    at_last = (positions == last_index) & mask
    return zero_masked(as_float(scores).unsqueeze(-1).expand(mask.shape), at_last)


def _reverse_discounted_scan(
    token_values: torch.Tensor, mask: torch.Tensor, discount: float, restart: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``y_t = x_t + discount * y_next`` right to left, where ``next`` is the next *valid* token.

    Masked positions output 0 and pass the running value through unchanged, so padding and holes
    neither contribute nor break the chain; at a ``restart`` position (bool ``[B, T]``) the running
    value starts again from 0, so the tokens before it see nothing from it onwards. ``token_values``
    must already be 0 on masked tokens.
    """
    running = torch.zeros_like(token_values[:, 0])
    outputs = torch.zeros_like(token_values)
    for t in reversed(range(token_values.shape[-1])):
        candidate = token_values[:, t] + discount * running
        running = torch.where(mask[:, t], candidate, running)
        if restart is not None:
            running = torch.where(restart[:, t], 0.0, running)
        outputs[:, t] = zero_masked(candidate, mask[:, t])
    return outputs


def _next_valid_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """For each position, the value at the next valid position to its right (0 if there is none)."""
    following = torch.zeros_like(values[:, 0])
    next_values = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        next_values[:, t] = following
        following = torch.where(mask[:, t], values[:, t], following)
    return next_values


@torch.no_grad()
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Over valid tokens only, right to left, with ``t+1`` meaning the next valid token and the value
    after the last valid token taken as 0 (the episode ends there):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (returns, the critic's target)

    Args:
        token_level_rewards, values, response_mask: ``[B, T]``.
        gamma: discount. lam: GAE lambda (1 gives Monte-Carlo returns minus values).
        whiten: batch-whiten the advantages over valid tokens (verl and OpenRLHF do); returns are
            never whitened.

    Returns:
        ``(advantages [B, T], returns [B, T])``, 0 on masked tokens.
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    rewards = zero_masked(token_level_rewards, mask)
    values = zero_masked(values, mask)
    # GAE is the (gamma * lam)-discounted sum of the TD errors delta_t, so one reverse scan over the
    # deltas gives it; V_{t+1} must be the value at the next *valid* token, not at column t+1.
    next_values = _next_valid_values(values, mask)
    deltas = zero_masked(rewards + gamma * next_values - values, mask)
    advantages = _reverse_discounted_scan(deltas, mask, gamma * lam)
    returns = zero_masked(advantages + values, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_centered_scores(
    scores: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(s_i - mean_g(s) [B], group index [B], group sizes [G], G)`` for float scores ``[B]``."""
    index, num_groups = group_index(group_ids, scores.shape[0], scores.device)
    group_sizes = group_sum(torch.ones_like(scores), index, num_groups)
    centered = scores - (group_sum(scores, index, num_groups) / group_sizes)[index]
    return centered, index, group_sizes, num_groups


@torch.no_grad()
def compute_grpo_outcome_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    normalize_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

        A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)     broadcast over the valid tokens of i

    with ``g`` the group (prompt) of sample i and ``std_g`` the Bessel-corrected standard deviation
    (as ``torch.std``, TRL and verl). ``normalize_by_std=False`` gives Dr. GRPO (Liu et al. 2025,
    arXiv:2503.20783): ``A_i = s_i - mean_g(s)``. A group of size 1 gets advantage 0.

    Args:
        scores: ``[B]``. response_mask: ``[B, T]``. group_ids: ``[B]`` prompt uids.

    Returns:
        ``(advantages [B, T], returns [B, T])``; returns are the scores broadcast over valid tokens.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    scores = as_float(scores)
    centered, index, group_sizes, num_groups = _group_centered_scores(scores, group_ids)
    if normalize_by_std:
        # Singleton groups have centered == 0 exactly and a clamped denominator, so they stay 0.
        group_variance = group_sum(centered.square(), index, num_groups) / (group_sizes - 1).clamp(min=1)
        centered = centered / (group_variance.sqrt()[index] + epsilon)
    return broadcast_to_tokens(centered, mask), broadcast_to_tokens(scores, mask)


@torch.no_grad()
def compute_dr_grpo_outcome_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantages (Liu et al. 2025, arXiv:2503.20783): ``A_i = s_i - mean_g(s)``, no std division.

    Same as ``compute_grpo_outcome_advantages(..., normalize_by_std=False)``. Pair it with the
    ``seq-mean-token-sum-norm`` loss aggregation to get the full Dr. GRPO objective.
    """
    return compute_grpo_outcome_advantages(scores, response_mask, group_ids, normalize_by_std=False)


@torch.no_grad()
def compute_rloo_outcome_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

        A_i = s_i - (1 / (n_g - 1)) * sum_{j in g, j != i} s_j  =  n_g / (n_g - 1) * (s_i - mean_g(s))

    A group of size 1 has no other sample to form a baseline and gets advantage 0.

    Shapes: scores ``[B]``, response_mask ``[B, T]``, group_ids ``[B]``; returns
    ``(advantages [B, T], returns [B, T])`` with returns the broadcast scores.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    scores = as_float(scores)
    centered, index, group_sizes, _ = _group_centered_scores(scores, group_ids)
    # Singleton groups: centered == 0 exactly, and the clamp avoids 0/0.
    advantages = centered * (group_sizes / (group_sizes - 1).clamp(min=1))[index]
    return broadcast_to_tokens(advantages, mask), broadcast_to_tokens(scores, mask)


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    restart_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262).

        G_t = r_t + gamma * G_{t+1}        (over valid tokens, right to left; G after the end is 0)
        A   = whiten(G)                    (batch mean/std over all valid tokens)

    Args:
        token_level_rewards, response_mask: ``[B, T]`` (rewards typically include the per-token KL
            penalty). gamma: discount.
        restart_mask: ``[B, T]`` masked positions at which ``G`` restarts from 0 (their rewards and
            everything after them are lost to the tokens before), as verl's return does at every
            masked position; the trainer passes the tokens the rollout correction rejected. None:
            holes are skipped.

    Returns:
        ``(advantages [B, T], returns [B, T])`` with returns = ``G`` before whitening.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    mask = check_response_mask(response_mask)
    restart = None
    if restart_mask is not None:
        check_same_shape(token_level_rewards=token_level_rewards, restart_mask=restart_mask)
        restart = check_response_mask(restart_mask) & ~mask
    returns = _reverse_discounted_scan(zero_masked(token_level_rewards, mask), mask, gamma, restart)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group-mean baseline, then batch whitening.

        A = whiten(broadcast(s_i - mean_g(s)))     whitening over all valid tokens of the batch

    Unlike GRPO the scale comes from the whole batch, not from each group's std.
    Shapes: scores ``[B]``, response_mask ``[B, T]``; returns ``(advantages [B, T], returns [B, T])``
    with returns the broadcast scores.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    scores = as_float(scores)
    centered = _group_centered_scores(scores, group_ids)[0]
    return masked_whiten(broadcast_to_tokens(centered, mask), mask), broadcast_to_tokens(scores, mask)


@torch.no_grad()
def compute_remax_outcome_advantages(
    token_level_rewards: torch.Tensor, baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, arXiv:2310.10505): the baseline is the score of the greedy response.

        G_t = sum_{u >= t, u valid} r_u       (the undiscounted reward-to-go)
        A_t = G_t - s_i^greedy                on the valid tokens of row i

    With only an outcome score at the last token ``G_t`` is the score on every token; with a KL
    penalty in the reward each token carries the penalties from itself onwards, as in verl.

    Shapes: token_level_rewards ``[B, T]``, baseline_scores ``[B]`` (score of the greedy decode of the
    same prompt), response_mask ``[B, T]``; returns ``(advantages [B, T], returns [B, T])`` with
    returns ``G``.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_sequence_values("baseline_scores", baseline_scores, response_mask)
    mask = check_response_mask(response_mask)
    reward_to_go = zero_masked(as_float(token_level_rewards), mask).flip(-1).cumsum(dim=-1).flip(-1)
    returns = zero_masked(reward_to_go, mask)
    return zero_masked(reward_to_go - as_float(baseline_scores).unsqueeze(-1), mask), returns


@torch.no_grad()
def compute_gpg_outcome_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG outcome advantages (Chu et al. 2025, arXiv:2504.02546), verl's formula.

        A_i   = alpha * (s_i - mean_g(s))         broadcast over the valid tokens of i
        alpha = B / max(M, 1),   M = #{j : s_j != 0}    over the B samples of the call

    The group-centred score is rescaled by the inverse fraction of samples with a nonzero score,
    which the paper's gradient-estimation correction motivates (verl counts nonzero *scores*;
    that is what is reproduced here). No std division. A group of size 1 gets advantage 0.

    Shapes: scores ``[B]``, response_mask ``[B, T]``, group_ids ``[B]``; returns
    ``(advantages [B, T], returns [B, T])`` with returns the broadcast scores.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    scores = as_float(scores)
    centered = _group_centered_scores(scores, group_ids)[0]
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    return broadcast_to_tokens(alpha * centered, mask), broadcast_to_tokens(scores, mask)


@torch.no_grad()
def compute_grpo_passk_outcome_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    normalize_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantages in GRPO form (arXiv:2503.19595, as cited by verl): only the best response counts.

    In each group ``g`` with best score ``s_(1)`` and second best ``s_(2)``:

        A_i = (s_(1) - s_(2)) / (std_g(s) + epsilon)   for the best sample i of g (one sample)
        A_j = 0                                        for every other sample of g

    Without ``normalize_by_std`` the gap is not divided. ``std_g`` is Bessel-corrected, as in
    GRPO. If several samples share the best score the gap is 0, so which of them is "the best"
    does not matter (here: the first in batch order). A group of size 1 has no second best and
    gets advantage 0.

    Args:
        scores: ``[B]``. response_mask: ``[B, T]``. group_ids: ``[B]`` prompt uids.
        normalize_by_std, epsilon: as in ``compute_grpo_outcome_advantages``.

    Returns:
        ``(advantages [B, T], returns [B, T])``; returns are the scores broadcast over valid tokens.
    """
    check_sequence_values("scores", scores, response_mask)
    mask = check_response_mask(response_mask)
    scores = as_float(scores)
    centered, index, group_sizes, num_groups = _group_centered_scores(scores, group_ids)
    batch_size = scores.shape[0]
    lowest = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best_score = lowest.scatter_reduce(0, index, scores, "amax")
    positions = torch.arange(batch_size, device=scores.device)
    best_candidates = torch.where(scores == best_score[index], positions, batch_size)
    first_best = torch.full((num_groups,), batch_size, device=scores.device).scatter_reduce(
        0, index, best_candidates, "amin"
    )
    is_best = positions == first_best[index]
    others = torch.where(is_best, -torch.inf, scores)
    second_score = lowest.scatter_reduce(0, index, others, "amax")
    # Select before subtracting: a singleton's second best is -inf.
    has_two = group_sizes >= 2
    gap = torch.where(has_two, best_score, 0.0) - torch.where(has_two, second_score, 0.0)
    if normalize_by_std:
        group_variance = group_sum(centered.square(), index, num_groups) / (group_sizes - 1).clamp(min=1)
        gap = gap / (group_variance.sqrt() + epsilon)
    advantages = torch.where(is_best, gap[index], 0.0)
    return broadcast_to_tokens(advantages, mask), broadcast_to_tokens(scores, mask)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae_advantages,
    "grpo": compute_grpo_outcome_advantages,
    "dr_grpo": compute_dr_grpo_outcome_advantages,
    "rloo": compute_rloo_outcome_advantages,
    "reinforce_plus_plus": compute_reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_advantages,
    "remax": compute_remax_outcome_advantages,
    "gpg": compute_gpg_outcome_advantages,
    "grpo_passk": compute_grpo_passk_outcome_advantages,
}

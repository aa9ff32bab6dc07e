"""Log-probabilities and entropy of given tokens from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary, ``[N, V/tp]``.
The full vocabulary is never gathered: per token, the ranks all-reduce a max, then a sum of
exponentials, the target's logit and ``sum p*z`` together (two collectives per chunk). Work runs over chunks
of ``chunk_tokens`` tokens, so fp32 temporaries are bounded by ``chunk_tokens * V/tp`` whatever
the sequence length, in the forward and in the backward (which recomputes the softmax per chunk
instead of saving it).

Columns at or beyond ``vocab_size`` (Megatron's padding rows, which exist only to make the
vocabulary split evenly) are excluded: they are not tokens and must not take probability mass.

    logp_t = z_t[y_t] - logsumexp(z_t)
    H_t    = logsumexp(z_t) - sum_v p_t[v] z_t[v]
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024


def all_reduce_in(tensor: torch.Tensor, op, group) -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (nothing to do without one, or on one rank)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def valid_columns(local_vocab: int, vocab_start: int, vocab_size: int) -> int:
    """How many of this rank's columns are real tokens; padding sits at the end of the vocabulary."""
    return max(0, min(local_vocab, vocab_size - vocab_start))


def _batched_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products ``[N]`` of ``[N, V]`` tensors, without an ``[N, V]`` product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


def _chunk_statistics(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group):
    """(logsumexp, target logit, sum p*z) of one token chunk, in fp32, with two ``[n, V_local]`` temporaries."""
    valid = valid_columns(logits.shape[-1], vocab_start, vocab_size)
    shifted = logits[:, :valid].to(torch.float32, copy=True)
    local_max = shifted.max(dim=-1).values if valid else torch.full(targets.shape, float("-inf"))
    global_max = all_reduce_in(local_max, dist.ReduceOp.MAX, group)
    shifted.sub_(global_max.unsqueeze(-1))
    exp = torch.exp(shifted)
    local_target = targets - vocab_start
    owned = (local_target >= 0) & (local_target < valid)
    picked = shifted.gather(-1, local_target.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1) if valid else torch.zeros_like(global_max)
    # The three sums in one all-reduce (each collective costs its latency): sum_v exp, the target's shifted logit
    # (on the rank that owns it, 0 elsewhere), and sum_v exp (z_v - max).
    sum_exp, target_shifted, dot = all_reduce_in(torch.stack([
        exp.sum(dim=-1), torch.where(owned, picked, torch.zeros_like(picked)), _batched_dot(exp, shifted)]),
        dist.ReduceOp.SUM, group)
    sum_pz = global_max + dot / sum_exp  # sum_v p_v z_v = max + sum_v p_v (z_v - max)
    lse = global_max + torch.log(sum_exp)
    return lse, global_max + target_shifted, sum_pz


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, chunk_tokens, with_entropy):
        logprobs = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lses, sums = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for start in range(0, targets.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            lses[rows], target_logit, sums[rows] = _chunk_statistics(logits[rows], targets[rows], vocab_start, vocab_size, group)
            logprobs[rows] = target_logit - lses[rows]
        ctx.save_for_backward(logits, targets, lses, sums)
        ctx.settings = (vocab_start, vocab_size, chunk_tokens)
        return logprobs, (lses - sums) if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lses, sums = ctx.saved_tensors
        vocab_start, vocab_size, chunk_tokens = ctx.settings
        valid = valid_columns(logits.shape[-1], vocab_start, vocab_size)
        grad_logits = torch.zeros_like(logits)  # padding columns get no gradient
        for start in range(0, targets.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = logits[rows, :valid].to(torch.float32, copy=True)
            probs = torch.exp(z - lses[rows].unsqueeze(-1))
            # d logp / dz = onehot(y) - p;  d H / dz = -p (z - sum p z)
            if grad_entropy is not None:
                z.sub_(sums[rows].unsqueeze(-1)).mul_(-grad_entropy[rows].unsqueeze(-1))
                z.sub_(grad_logprobs[rows].unsqueeze(-1))
                grad = probs.mul_(z)
            else:
                grad = probs.mul_(-grad_logprobs[rows].unsqueeze(-1))
            local_target = targets[rows] - vocab_start
            owned = (local_target >= 0) & (local_target < valid)
            grad[owned, local_target[owned]] += grad_logprobs[rows][owned]
            grad_logits[rows, :valid] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and optionally entropy) of ``targets`` under vocabulary-parallel ``logits``.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary slice (any float dtype; math in fp32).
        targets: ``[N]`` token ids in the full vocabulary.
        vocab_size: the real vocabulary size; columns at or past it are padding and ignored.
        vocab_start: the first vocabulary id of this rank's slice (``tp_rank * V_local``).
        group: the tensor-parallel group (None on one rank).
        chunk_tokens: tokens per chunk; bounds the fp32 temporaries to ``chunk_tokens * V_local``.
        with_entropy: also return the entropy ``[N]`` of each token's distribution.

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in fp32, differentiable with respect to ``logits``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V_local] and targets [N], got {list(logits.shape)} and {list(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _VocabParallelLogProbs.apply(logits, targets, vocab_start, vocab_size, group, chunk_tokens, with_entropy)

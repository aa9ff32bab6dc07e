"""Log-probabilities of several given tokens per position from vocabulary-parallel logits (differentiable).

``rlmega.workers.logprobs`` gives the log-prob of one target per token; on-policy distillation's top-k term
needs the student's log-probs at the teacher's k most likely ids at every position, with gradients. Each
tensor-parallel rank holds the logits of its slice of the (padded) vocabulary, ``[N, V/tp]``; the vocabulary
is never gathered. Per token chunk: one all-reduce of the max, then one of the sum of exponentials together
with the targets' logits (each on the rank that owns it, 0 elsewhere). The backward recomputes the softmax
per chunk, so fp32 temporaries stay bounded by ``chunk_tokens * V/tp``. Padding columns (at or past
``vocab_size``) are no tokens: they take no probability and get no gradient.

    logp_t[j]        = z_t[y_tj] - logsumexp(z_t)
    d logp_t[j] / dz = onehot(y_tj) - p_t
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rlmega.workers.logprobs import DEFAULT_CHUNK_TOKENS, all_reduce_in, valid_columns


def _chunk_logprobs(logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, valid: int, group):
    """(log-probs ``[n, k]``, logsumexp ``[n]``) of one token chunk, in fp32."""
    shifted = logits[:, :valid].to(torch.float32, copy=True)
    rows = local_targets.shape[0]
    local_max = shifted.max(dim=-1).values if valid else torch.full((rows,), float("-inf"), device=logits.device)
    global_max = all_reduce_in(local_max, dist.ReduceOp.MAX, group)
    shifted.sub_(global_max.unsqueeze(-1))
    picked = shifted.gather(-1, local_targets) if valid else torch.zeros(local_targets.shape, device=logits.device)
    # One all-reduce for both sums: sum_v exp (z_v - max), and each target's shifted logit (owner's, 0 elsewhere).
    sums = all_reduce_in(torch.cat([torch.exp(shifted).sum(dim=-1, keepdim=True),
                                  torch.where(owned, picked, torch.zeros_like(picked))], dim=-1),
                       dist.ReduceOp.SUM, group)
    log_sum_exp = torch.log(sums[:, :1])
    return sums[:, 1:] - log_sum_exp, global_max + log_sum_exp[:, 0]


def _local(targets: torch.Tensor, vocab_start: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as this rank's column indices (clamped into range where another rank owns them), and ownership."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < valid)
    return local.clamp(0, max(valid - 1, 0)), owned


class _VocabParallelTargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, chunk_tokens):
        valid = valid_columns(logits.shape[-1], vocab_start, vocab_size)
        local_targets, owned = _local(targets, vocab_start, valid)
        logprobs = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lses = torch.empty(targets.shape[:1], dtype=torch.float32, device=logits.device)
        for start in range(0, targets.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logprobs[rows], lses[rows] = _chunk_logprobs(logits[rows], local_targets[rows], owned[rows], valid, group)
        ctx.save_for_backward(logits, local_targets, owned, lses)
        ctx.settings = (valid, chunk_tokens)
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        logits, local_targets, owned, lses = ctx.saved_tensors
        valid, chunk_tokens = ctx.settings
        grad_logits = torch.zeros_like(logits)  # padding columns get no gradient
        if not valid:
            return grad_logits, None, None, None, None, None
        for start in range(0, local_targets.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            upstream = grad_logprobs[rows].float()
            grad = torch.exp(logits[rows, :valid].float() - lses[rows].unsqueeze(-1))
            grad.mul_(-upstream.sum(dim=-1, keepdim=True))  # sum_j g_j * (-p)
            grad.scatter_add_(-1, local_targets[rows], torch.where(owned[rows], upstream, torch.zeros_like(upstream)))
            grad_logits[rows, :valid] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None, None


def vocab_parallel_target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Log-probs of ``k`` given tokens per row under vocabulary-parallel ``logits``.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary slice (any float dtype; math in fp32).
        targets: ``[N, k]`` token ids in the full vocabulary, each below ``vocab_size``.
        vocab_size: the real vocabulary size; columns at or past it are padding and ignored.
        vocab_start: the first vocabulary id of this rank's slice (``tp_rank * V_local``).
        group: the tensor-parallel group (None on one rank).
        chunk_tokens: rows per chunk; bounds the fp32 temporaries to ``chunk_tokens * V_local``.

    Returns:
        ``[N, k]`` fp32 log-probs (full-vocabulary normalisation), the same on every rank of ``group``,
        differentiable with respect to ``logits``.
    """
    if logits.dim() != 2 or targets.dim() != 2 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"expected logits [N, V_local] and targets [N, k], got {list(logits.shape)} and "
                         f"{list(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"target ids must lie in [0, {vocab_size}) (the vocabulary), got "
                         f"{int(targets.min())}..{int(targets.max())}")
    return _VocabParallelTargetLogProbs.apply(logits, targets.long(), vocab_start, vocab_size, group, chunk_tokens)

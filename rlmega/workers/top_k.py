"""A model's k most likely tokens at each response position, from vocabulary-parallel logits.

On-policy distillation's top-k estimator needs, per position of the student's response, the teacher's
``k`` most likely tokens and their log-probs. Each tensor-parallel rank holds the logits of its slice of
the (padded) vocabulary, ``[N, V/tp]``; the vocabulary is never gathered. Each rank takes its slice's
top-k (values and global ids) and its slice's logsumexp, the ranks all-gather those ``2k + 1`` numbers
per token (one collective per chunk), and every rank merges them: the top-k of the ``tp * k`` candidates
is the global top-k (each global top-k token is in its own rank's local top-k), and the global
logsumexp is the logsumexp of the local ones. Columns at or past ``vocab_size`` (Megatron's padding)
are excluded, as in ``rlmega.workers.logprobs``.

    top-k ids_t   = argtopk_v z_t[v]
    top-k logp_t  = z_t[ids_t] - logsumexp_v z_t[v]
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.distributed as dist

from rlmega.models.spec import padded_vocab_size
from rlmega.workers.batching import MicroBatch, concatenated_ranges
from rlmega.workers.context_parallel import gather_response_values
from rlmega.workers.heads import attached_to_graph, response_rows
from rlmega.workers.logprobs import DEFAULT_CHUNK_TOKENS
from rlmega.workers.passes import Head, HeadResult, results_elsewhere, reporting_rank


def _chunk_top_k(logits: torch.Tensor, k: int, vocab_start: int, vocab_size: int, group) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
    """(ids ``[n, k]`` int64, log-probs ``[n, k]`` fp32) of one token chunk."""
    rows = logits.shape[0]
    valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))  # this rank's real (not padding) columns
    z = logits[:, :valid].float()
    # Per token: k candidate values, their global ids, this slice's logsumexp; float64 holds the ids exactly.
    packed = torch.full((rows, 2 * k + 1), float("-inf"), dtype=torch.float64, device=logits.device)
    taken = min(k, valid)
    if taken:
        values, columns = z.topk(taken, dim=-1)
        packed[:, :taken] = values.double()
        packed[:, k:k + taken] = (columns + vocab_start).double()
        packed[:, -1] = torch.logsumexp(z, dim=-1).double()
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, packed, group=group)
        packed = torch.stack(parts, dim=1)  # [n, tp, 2k + 1]
    else:
        packed = packed.unsqueeze(1)
    candidates, candidate_ids = packed[..., :k].reshape(rows, -1), packed[..., k:2 * k].reshape(rows, -1)
    logsumexp = torch.logsumexp(packed[..., -1], dim=-1)  # a slice of padding only adds exp(-inf) = 0
    values, where = candidates.topk(k, dim=-1)
    return candidate_ids.gather(-1, where).long(), (values - logsumexp.unsqueeze(-1)).float()


@torch.no_grad()
def vocab_parallel_top_k(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row of vocabulary-parallel ``logits`` (not differentiable).

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary slice (any float dtype; math in fp32).
        k: tokens per row, at most ``vocab_size``.
        vocab_size: the real vocabulary size; columns at or past it are padding and ignored.
        vocab_start: the first vocabulary id of this rank's slice (``tp_rank * V_local``).
        group: the tensor-parallel group (None on one rank).
        chunk_tokens: rows per chunk; bounds the fp32 temporaries to ``chunk_tokens * V_local``.

    Returns:
        ``(ids [N, k] int64, logprobs [N, k] fp32)``, most likely first, the same on every rank of ``group``.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits [N, V_local], got {list(logits.shape)}")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k needs 1 <= k <= the vocabulary size {vocab_size}, got k={k}")
    ids = torch.empty((logits.shape[0], k), dtype=torch.long, device=logits.device)
    logprobs = torch.empty((logits.shape[0], k), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        ids[rows], logprobs[rows] = _chunk_top_k(logits[rows], k, vocab_start, vocab_size, group)
    return ids, logprobs


def top_k_head(vocab_size: int, k: int, chunk_tokens: int, logit_scale: float = 1.0) -> Head:
    """Per response token, the ``k`` most likely next tokens under ``softmax(logits / logit_scale)`` (forward
    only): output ``top_k`` ``[N, 2k]``, the ids then the log-probs (float64, which holds both exactly)."""

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        from megatron.core import parallel_state as ps

        rows = response_rows(micro_batch, output)
        if logit_scale != 1.0:
            rows = rows / logit_scale
        tp = ps.get_tensor_model_parallel_world_size()
        ids, logprobs = vocab_parallel_top_k(
            rows, k, vocab_size=vocab_size,
            vocab_start=ps.get_tensor_model_parallel_rank() * (padded_vocab_size(vocab_size, tp) // tp),
            group=ps.get_tensor_model_parallel_group(), chunk_tokens=chunk_tokens)
        packed = torch.cat([ids.double(), logprobs.double()], dim=-1)
        return HeadResult(loss=attached_to_graph(output), outputs={"top_k": gather_response_values(packed, micro_batch)})

    return head


def scatter_top_k(results: list[Optional[HeadResult]], micro_batches: list[MicroBatch], response_lengths: list[int],
                  k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence of the whole batch, on every rank: ids ``[R_i, k]`` int64 and log-probs ``[R_i, k]`` fp32 (as
    ``passes.scatter_outputs`` assembles per-token outputs: the reporting rank of each replica writes its
    sequences, and one sum over the ranks, where they hold different results, gives everyone all of them)."""
    offsets = list(itertools.accumulate(response_lengths, initial=0))
    flat = torch.zeros((offsets[-1], 2 * k), dtype=torch.float64)
    elsewhere = results_elsewhere()
    if reporting_rank() or not elsewhere:
        for result, micro_batch in zip(results, micro_batches):
            slots = concatenated_ranges([offsets[index] for index in micro_batch.indices], micro_batch.response_lengths)
            flat[slots] = result.outputs["top_k"].detach().double().cpu()
    if elsewhere:
        dist.all_reduce(flat)
    parts = flat.split(response_lengths)
    return [part[:, :k].long() for part in parts], [part[:, k:].float() for part in parts]

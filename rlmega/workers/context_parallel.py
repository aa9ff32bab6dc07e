"""Context parallelism: the ``cp`` ranks of a data-parallel replica share every sequence's tokens.

A micro-batch is built whole (``batching.build_micro_batch``) and then split along the sequence:
each *segment* (a row of a padded batch, the whole packed row with a mask on CPU, or one
sequence's padded slot of a THD row) of length ``L`` (a multiple of ``2 * cp``) is cut into
``2 * cp`` chunks, and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``. Under a causal mask
the early chunks are cheap and the late ones costly, so this pairing gives every rank the same
attention work; it is also the layout Megatron's rotary embedding and transformer-engine's
context-parallel attention expect.

The attention exchanges keys and values between the ranks. Everything after the last layer is
per token: each rank computes the log-probs (or values) of the response tokens it holds, and
``gather_response_values`` assembles them in the micro-batch's order on every rank. The loss is
then computed from the whole sequences, identically on each CP rank; the gathered tensor only
back-propagates into the rank's own tokens, so the parameter gradients of the CP ranks add up
to the full one (Megatron's DDP sums them over the data- and context-parallel ranks).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from rlmega.parallel.layout import zigzag_positions
from rlmega.workers.batching import MicroBatch


def segment_positions(segment_lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """This rank's positions in a row made of consecutive segments, each split by ``zigzag_positions``."""
    parts, offset = [], 0
    for length in segment_lengths:
        parts.append(zigzag_positions(length, cp, rank) + offset)
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclasses.dataclass
class ContextShare:
    """How a micro-batch's response tokens are spread over the CP ranks."""

    rank: int
    counts: list[int]
    """Response tokens held by each CP rank."""
    restore: torch.Tensor
    """``[N]``: the response tokens concatenated rank by rank, indexed by this, are in micro-batch order."""
    columns: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per CP rank, the columns of the whole micro-batch it holds, in its order."""


def _segments(micro_batch: MicroBatch) -> list[int]:
    params = micro_batch.packed_seq_params
    if params is None:  # padded rows, or one packed row whose mask keeps the sequences apart
        return [micro_batch.tokens.shape[1]]
    cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return torch.diff(cu_seqlens.long()).tolist()


def split_micro_batch(micro_batch: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """CP ``rank``'s share of ``micro_batch``: its tokens and position ids, its response tokens.

    The attention mask stays whole (the attention picks the rows of its queries) and so do the
    packed-sequence parameters (transformer-engine splits by them itself).
    """
    width = micro_batch.tokens.shape[1]
    segments = _segments(micro_batch)
    columns = [segment_positions(segments, cp, r) for r in range(cp)]
    owner = torch.empty(width, dtype=torch.long)
    local_index = torch.empty(width, dtype=torch.long)
    for r, held in enumerate(columns):
        owner[held] = r
        local_index[held] = torch.arange(held.numel())
    rows, cols = micro_batch.response_positions // width, micro_batch.response_positions % width
    owners = owner[cols]
    order = torch.cat([torch.nonzero(owners == r).flatten() for r in range(cp)])
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    mine = owners == rank
    local_width = columns[rank].numel()
    return dataclasses.replace(
        micro_batch,
        tokens=micro_batch.tokens[:, columns[rank]],
        position_ids=micro_batch.position_ids[:, columns[rank]],
        response_positions=rows[mine] * local_width + local_index[cols[mine]],
        response_targets=micro_batch.response_targets[mine],
        context_share=ContextShare(rank, [int((owners == r).sum()) for r in range(cp)], restore, columns),
        routing=None if micro_batch.routing is None else micro_batch.routing[:, columns[rank]],
    )


def local_response_indices(micro_batch: MicroBatch) -> Optional[torch.Tensor]:
    """``[n]``: which of the micro-batch's response tokens (in its order) this CP rank holds, in the rank's order;
    None without context parallelism (the rank holds them all). Per-token inputs of a whole micro-batch, indexed
    by this, line up with the rank's response rows."""
    share = micro_batch.context_share
    if share is None:
        return None
    order = torch.empty_like(share.restore)
    order[share.restore] = torch.arange(share.restore.numel())
    start = sum(share.counts[:share.rank])
    return order[start:start + share.counts[share.rank]]


def gather_response_values(local: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """``[N]`` per-token values of the whole micro-batch from this rank's ``[n]`` (or ``[N, c]`` from ``[n, c]``:
    several values per token), on every CP rank.

    Differentiable with respect to ``local`` only: each rank back-propagates the (identical) loss
    into its own tokens. Collective over the context-parallel group.
    """
    share = micro_batch.context_share
    if share is None:
        return local
    from megatron.core import parallel_state as ps

    width = max(share.counts)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[:local.shape[0]] = local.detach()
    parts = [torch.empty_like(padded) for _ in share.counts]
    dist.all_gather(parts, padded, group=ps.get_context_parallel_group())
    parts = [part[:count] for part, count in zip(parts, share.counts)]
    parts[share.rank] = local
    return torch.cat(parts)[share.restore.to(local.device)]

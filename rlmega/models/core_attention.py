"""Softmax core attention in plain torch: the attention of every model without transformer-engine.

Megatron-Core 0.16's local spec builds ``DotProductAttention``, which

* rejects the distinct query/key and value head sizes of Multi-Latent Attention (the query/key
  head size ``qk_head_dim + qk_pos_emb_head_dim`` differs from ``v_head_dim``),
* asserts ``context_parallel_size == 1`` (context parallelism is TE's attention's job on GPU), and
* materialises every ``[heads, S, S]`` score matrix and keeps the softmax for the backward.

``TorchCoreAttention`` runs torch's fused ``scaled_dot_product_attention`` for all three (7x less
memory and 3x faster on a 6k-token update: ``benchmarks/context_parallel.py``). Under context
parallelism it all-gathers the keys and values of the CP group (each rank holds the zigzag share
of the sequence described in ``rlmega.workers.context_parallel``) and attends from its own
queries, so CP runs for real on CPU; transformer-engine's ring attention is the fast path on GPU.
A packed row (sequences one after another, a block-causal mask) is attended one sequence at a time
rather than as one ``S x S`` problem: on the tiny CPU job's 64-sequence updates that is what took the
backward's time.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlmega.models.attention_mask import block_causal_mask
from rlmega.parallel.layout import zigzag_positions


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the backward sums the gradients of every rank's
    queries and keeps this rank's slice (gloo has no reduce-scatter, so all-reduce then slice)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size], None


class TorchCoreAttention(MegatronModule):
    """``softmax(q k^T * scale + mask) v`` per head; grouped-query heads; q/k head size may differ
    from v's; context parallel by gathering keys and values.

    Takes Megatron's ``[seq, batch, heads, dim]`` layout and returns ``[seq_q, batch, heads * v_dim]``.
    Runs torch's ``scaled_dot_product_attention``; with attention dropout in training, an explicit
    softmax (in fp32) so the dropout uses Megatron's RNG streams.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if getattr(config, "window_size", None) is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("TorchCoreAttention supports neither sliding windows nor softmax offsets; install transformer-engine")
        self.attn_mask_type = attn_mask_type
        # Megatron's MLA builds its core attention once without head sizes before rebuilding it
        # with them; None means "take it from the tensors".
        self.k_channels = k_channels
        self.v_channels = v_channels
        self.softmax_scale = softmax_scale
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query: [sq, b, n, dk]; key: [sk, b, g, dk]; value: [sk, b, g, dv] -> [sq, b, n * dv]
        (``g`` key/value heads, dividing ``n``).

        ``attention_mask``: bool, True where attention is *not* allowed, broadcastable to
        [b, n, S, S] over the whole sequence; with a causal ``attn_mask_type`` the causal mask is
        applied as well. Under context parallelism ``sq`` and ``sk`` are this rank's share of ``S``.
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("TorchCoreAttention supports neither THD packed sequences nor attention bias")
        heads, dk, dv = query.shape[2], query.shape[-1], value.shape[-1]
        if self.k_channels is not None and (dk, dv) != (self.k_channels, self.v_channels):
            raise ValueError(f"expected q/k head size {self.k_channels} and v head size {self.v_channels}, got {dk} and {dv}")
        query_positions = key_positions = None
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp > 1:
            total = query.shape[0] * cp
            key_positions = torch.cat([zigzag_positions(total, cp, r) for r in range(cp)])
            query_positions = zigzag_positions(total, cp, dist.get_rank(self.cp_group))
            key, value = _GatherSequence.apply(torch.cat([key, value], dim=-1), self.cp_group).split([dk, dv], dim=-1)
        if key.shape[2] != heads:
            key, value = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (key, value))
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dk)

        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        dropout = self.training and self.dropout.p > 0
        row = cp == 1 and query.shape[1] == 1 and query.shape[0] == key.shape[0]  # one packed row, all of it here
        segments = packed_segments(attention_mask) if row and not dropout else None
        if segments is not None:  # a packed row: each sequence attends on its own
            context = _attend_by_segment(q, k, v, segments, scale)
        else:
            masked = _blocked(attention_mask, attn_mask_type or self.attn_mask_type, query.shape[0], key.shape[0],
                              query_positions, key_positions, q.device)
            if dropout:
                context = self._attend_with_dropout(q, k, v, masked, scale)
            else:  # torch's fused kernel: the same softmax attention, faster (every query sees at least itself)
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if masked is None else ~masked, scale=scale)
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], heads * dv)

    def _attend_with_dropout(self, q, k, v, masked, scale: float) -> torch.Tensor:
        """Explicit softmax attention, so the dropout draws from Megatron's RNG streams."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, n, sq, sk]
        if masked is not None:
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if self.config.sequence_parallel:  # the RNG stream Megatron's DotProductAttention uses
            probs = self.dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        return torch.matmul(probs, v)  # [b, n, sq, dv]


_last_segments: tuple = (lambda: None, None)
"""The last mask ``packed_segments`` read (a weak reference) and its answer: every layer gets the same mask."""


def packed_segments(attention_mask: Optional[torch.Tensor]) -> Optional[list[int]]:
    """The segment lengths when ``attention_mask`` ([1, 1, S, S], True = blocked) is exactly a packed row's
    block-causal mask (``block_causal_mask``) and attending segment by segment costs
    less than attending over the whole row; else None."""
    global _last_segments
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[:2] != (1, 1):
        return None
    if _last_segments[0]() is attention_mask:
        return _last_segments[1]
    blocked = attention_mask[0, 0]
    total = blocked.shape[-1]
    if blocked.shape[0] != total or blocked.dtype != torch.bool or total < 2:
        return None
    lengths = getattr(attention_mask, "segment_lengths", None)  # block_causal_mask made it: no need to read it
    if lengths is None:
        # Query i sees key i - 1 exactly when both are in one segment; then the mask must be block-causal.
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(blocked.diagonal(-1)).flatten().cpu() + 1])
        lengths = torch.diff(starts, append=torch.tensor([total])).tolist()
        if not torch.equal(attention_mask.cpu(), block_causal_mask(lengths)):
            lengths = None
    segments = lengths if lengths and len(lengths) * max(lengths) ** 2 < total ** 2 else None
    _last_segments = (weakref.ref(attention_mask), segments)
    return segments


def _attend_by_segment(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """Causal attention within each segment of a packed row ``[1, n, S, d]``: the segments are laid out as rows
    of a right-padded batch (a padded key comes after every real query of its row, so causality hides it) and
    the real positions gathered back, in the row's order."""
    longest = max(lengths)
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    offsets = torch.arange(longest)
    real = offsets.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [J, L]
    index = torch.where(real, starts.unsqueeze(1) + offsets.unsqueeze(0), starts.unsqueeze(1)).flatten().to(q.device)
    # index_select, not advanced indexing: the same values, and its backward (index_add_) is the faster one on CPU.
    rows = [t[0].index_select(1, index).unflatten(1, real.shape).transpose(0, 1) for t in (q, k, v)]  # [J, n, L, d]
    context = torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True, scale=scale)
    kept = torch.nonzero(real.flatten()).flatten().to(q.device)
    return context.transpose(0, 1).flatten(1, 2).index_select(1, kept).unsqueeze(0)  # [1, n, S, dv]


def _blocked(attention_mask, mask_type, sq: int, sk: int, query_positions, key_positions, device) -> Optional[torch.Tensor]:
    """The bool mask of disallowed (query, key) pairs, or None when every pair may attend.

    Without positions, query i sits at key position i + (sk - sq); with them (context
    parallelism) both are positions in the whole sequence, which the given mask is over.
    """
    if query_positions is None:
        query_positions = torch.arange(sq) + (sk - sq)
        key_positions = torch.arange(sk)
    elif attention_mask is not None:
        attention_mask = attention_mask[..., query_positions.to(device), :][..., key_positions.to(device)]
    masked = attention_mask
    if mask_type == AttnMaskType.causal:
        causal = (key_positions.unsqueeze(0) > query_positions.unsqueeze(1)).to(device)
        masked = causal if masked is None else masked | causal
    return masked

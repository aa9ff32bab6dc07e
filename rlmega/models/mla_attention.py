"""Core attention for Multi-Latent Attention without transformer-engine.

Megatron-Core 0.16's local MLA spec uses ``DotProductAttention``, which rejects the ``k_channels``
/ ``v_channels`` that MLA passes and assumes one head size for queries, keys and values. In MLA
the query/key head size (``qk_head_dim + qk_pos_emb_head_dim``) differs from the value head size
(``v_head_dim``). ``MLACoreAttention`` is the plain softmax attention for that case; with TE
installed the TE spec's attention is used instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class MLACoreAttention(MegatronModule):
    """``softmax(q k^T * scale + mask) v`` per head, with q/k head size != v head size.

    Takes Megatron's ``[seq, batch, heads, dim]`` layout and returns ``[seq_q, batch, heads * v_dim]``.
    The softmax runs in fp32 (as in Hugging Face's eager attention) whatever the input dtype.
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
        if config.context_parallel_size > 1:
            raise ValueError("MLACoreAttention does not support context parallelism; install transformer-engine")
        self.attn_mask_type = attn_mask_type
        # Megatron's Attention base class builds its core attention once without head sizes before
        # MLA rebuilds it with them; None means "take it from the tensors".
        self.k_channels = k_channels
        self.v_channels = v_channels
        self.softmax_scale = softmax_scale
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

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
        """query: [sq, b, n, dk]; key: [sk, b, n, dk]; value: [sk, b, n, dv] -> [sq, b, n * dv].

        ``attention_mask``: bool, True where attention is *not* allowed, broadcastable to
        [b, n, sq, sk]; with a causal ``attn_mask_type`` the causal mask is applied as well.
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("MLACoreAttention supports neither packed sequences nor attention bias")
        sq, batch, heads, dk = query.shape
        sk, dv = key.shape[0], value.shape[-1]
        if self.k_channels is not None and (dk, dv) != (self.k_channels, self.v_channels):
            raise ValueError(f"expected q/k head size {self.k_channels} and v head size {self.v_channels}, got {dk} and {dv}")
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dk)

        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, n, sq, sk]
        masked = self._mask(attention_mask, attn_mask_type or self.attn_mask_type, sq, sk, scores.device)
        if masked is not None:
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if self.training and self.dropout.p > 0:
            if self.config.sequence_parallel:  # the RNG stream Megatron's DotProductAttention uses
                probs = self.dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.dropout(probs)
        context = torch.matmul(probs, v)  # [b, n, sq, dv]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * dv)

    @staticmethod
    def _mask(attention_mask, mask_type, sq: int, sk: int, device) -> Optional[torch.Tensor]:
        """The bool mask of disallowed positions, or None when every position may attend."""
        masked = attention_mask
        if mask_type == AttnMaskType.causal:
            # Query i sits at key position i + (sk - sq): it sees keys up to and including itself.
            causal = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1 + sk - sq)
            masked = causal if masked is None else masked | causal
        return masked

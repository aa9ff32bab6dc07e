"""The block-causal attention mask of a packed row, in torch alone: the workers build it for their
micro-batches (without importing Megatron), attention reads the segments back from it."""

from __future__ import annotations

import torch


def block_causal_mask(segment_lengths: list[int]) -> torch.Tensor:
    """``[1, 1, S, S]`` bool mask (True = masked) letting each token see only earlier tokens of its segment.
    The mask carries ``segment_lengths`` as an attribute, so that attention need not read them back from it."""
    lengths = torch.tensor(segment_lengths, dtype=torch.long)
    first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # each token's segment start
    position = torch.arange(first.numel())
    # Query i may see keys first[i]..i: three passes over the S x S mask (it is large for a packed row).
    mask = (position.unsqueeze(0) > position.unsqueeze(1)) | (position.unsqueeze(0) < first.unsqueeze(1))
    mask = mask.view(1, 1, *mask.shape)
    mask.segment_lengths = list(segment_lengths)
    return mask

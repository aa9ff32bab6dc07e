"""Shared helpers for rlmega.algos: input checks, masked reductions, prompt grouping, registry lookup."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar, Union

import torch

GroupIds = Union[torch.Tensor, Iterable[Hashable]]

_Entry = TypeVar("_Entry")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every tensor and its shape unless all shapes are equal."""
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if len(set(shapes.values())) > 1:
        described = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: expected equal shapes, got {described}")


def check_response_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """Check that the mask is ``[B, T]`` and return it as bool (nonzero entries are valid tokens)."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {list(response_mask.shape)}")
    return response_mask.bool()


def check_sequence_values(name: str, values: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Check that a per-sequence tensor is ``[B]`` for a ``[B, T]`` mask."""
    if values.dim() != 1 or values.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"{name} must be [B] for response_mask [B, T] = {list(response_mask.shape)}, "
            f"got {name} {list(values.shape)}"
        )


def as_float(values: torch.Tensor) -> torch.Tensor:
    """Integer or bool scores (e.g. 0/1 accuracy) become float32; floating tensors are kept as they are."""
    return values if values.is_floating_point() else values.float()


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Replace entries outside ``mask`` by 0.

    ``torch.where`` (not multiplication) so that inf/nan padding cannot leak as ``nan * 0``, and so
    that no gradient reaches masked entries.
    """
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (bool, same shape); 0 when the mask is empty."""
    total = zero_masked(values, mask).sum()
    return total / mask.sum().clamp(min=1)


def broadcast_to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``[B]`` values copied onto every valid token of a ``[B, T]`` bool mask, 0 elsewhere."""
    return zero_masked(sequence_values.unsqueeze(-1).expand(mask.shape), mask)


def group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map group ids (one per sample) to dense indices ``0..G-1``.

    Args:
        group_ids: ``[B]`` integer tensor, or any length-``B`` iterable of hashable ids (strings,
            ints, tuples, a numpy array ...). Samples of one group may appear anywhere in the batch.
        batch_size: expected ``B``.
        device: device of the returned index tensor.

    Returns:
        ``(index [B] long, number_of_groups)``.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(f"group_ids must be [B] with B = {batch_size}, got shape {list(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError("group_ids tensor must hold integers, got a floating-point tensor")
        unique_ids, index = torch.unique(group_ids, return_inverse=True)
        return index.to(device), unique_ids.numel()
    dense: dict[Hashable, int] = {}
    indices = [dense.setdefault(group_id, len(dense)) for group_id in group_ids]
    if len(indices) != batch_size:
        raise ValueError(f"group_ids must have B = {batch_size} entries, got {len(indices)}")
    return torch.tensor(indices, dtype=torch.long, device=device), len(dense)


def group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of ``values [B]`` within each group: ``[G]``."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def lookup(registry: Mapping[str, _Entry], name: str, kind: str) -> _Entry:
    """``registry[name]``, or a ValueError that lists the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}")
    return registry[name]

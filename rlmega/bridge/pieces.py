"""A sharded Megatron model as each rank's own pieces of the HF tensors, and where every piece lies.

``export.py`` gathers every tensor whole; an engine that reshards on its side (vLLM 0.33's ``nccl_m2n`` and
``sharded_rdt`` weight-transfer backends, see ``rlmega.rollout.vllm_weight_source``) wants the opposite: every
HF tensor declared once with its full shape and the trainer ranks that hold it, and each of those ranks handing
over only its piece, with no gather. This module is that declaration and those pieces.

Each HF tensor is owned by the ranks of the tensor-parallel group that holds its parameter (its expert-TP group
for an expert; one rank without TP), in TP order, and is either held whole by each of them (norms, routers, a
replicated weight) or split evenly along one dimension, rank r holding chunk r (``torch.chunk``'s split): a row-
or column-parallel weight, q, k and v of a fused QKV (TP ranks own whole query groups, so each projection's rows
split evenly), gate and up of a fused ``linear_fc1``, and an embedding or LM head whose vocabulary Megatron did
not pad. A padded vocabulary does not split like that (the last rank holds padding rows), so its TP ranks each
gather it and hold it whole. Only data-parallel replica 0 (with its context-parallel ranks) owns anything, as in
the export.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from rlmega.bridge.export import announce_units, gather_tp, planned
from rlmega.bridge.mapping import QKV, VOCAB, Geometry, to_hf
from rlmega.bridge.params import gathered_shape, geometry_of
from rlmega.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where one HF tensor lies across the trainer's ranks."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The full HF shape."""
    owners: tuple[int, ...]
    """Global ranks that hold it, in tensor-parallel order."""
    split_dim: Optional[int]
    """The dimension split evenly over ``owners`` (owner i holds chunk i), or None: each owner holds it whole."""

    def local_shape(self) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] //= len(self.owners)
        return tuple(shape)

    @property
    def local_nbytes(self) -> int:
        return torch.Size(self.local_shape()).numel() * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One Megatron parameter's pieces (q, k, v of a fused QKV; gate and up of a ``linear_fc1``)."""

    canonical: str
    pieces: tuple[Piece, ...]


def _splits_evenly(rule, param, tp: int, geometry) -> bool:
    if param.partition_dim is None or tp == 1:
        return False
    if rule.transform == VOCAB:
        return gathered_shape(param, tp)[0] == geometry.vocab_size
    return True


def _piece_unit(canonical: str, entry: tuple, full: dict, geometry: Geometry) -> _Unit:
    param, rule, _, group, _, tp = entry
    # Every rank of the TP group holds the tensor, split or whole; only a padded vocabulary is gathered.
    owners = tuple(dist.get_process_group_ranks(group)) if tp > 1 else (dist.get_rank(),)
    split_dim = None
    if _splits_evenly(rule, param, tp, geometry):  # q/k/v and gate/up split by rows, like the fused tensor
        split_dim = 0 if rule.transform in (QKV, VOCAB) or len(full) > 1 else param.partition_dim
    return _Unit(canonical, tuple(Piece(name, t.dtype, tuple(t.shape), owners, split_dim) for name, t in full.items()))


def _announce(exported: dict, spec: ModelSpec) -> list[_Unit]:
    return announce_units(exported, spec, _piece_unit)


def piece_layout(chunks: list, spec: ModelSpec) -> list[Piece]:
    """Every HF tensor of the model and where it lies; the same list on every rank.

    Collective the first time for a model (the ranks exchange what they hold), then cached."""
    return [piece for unit in planned(chunks, spec, _announce)[1] for piece in unit.pieces]


def _owned(chunks: list, spec: ModelSpec) -> Iterator[tuple[_Unit, tuple, Geometry]]:
    """Each unit this rank owns, in layout order, with its parameter's export entry and the model's geometry."""
    geometry = geometry_of(spec)
    exported, units = planned(chunks, spec, _announce)
    rank = dist.get_rank()
    for unit in units:
        if rank in unit.pieces[0].owners:
            yield unit, exported[unit.canonical], geometry


@torch.no_grad()
def local_pieces(chunks: list, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's piece of each HF tensor it owns, in ``piece_layout`` order.

    Every rank iterates to the end: a padded vocabulary is gathered by its TP group."""
    for unit, (param, rule, names, group, tp_rank, tp), geometry in _owned(chunks, spec):
        if unit.pieces[0].split_dim is not None:  # this rank's own rows: the fused tensor's local query groups
            local = dataclasses.replace(geometry, num_query_groups=geometry.num_query_groups // tp)
            tensors = to_hf(rule, param.tensor.detach(), names, local, 1)
        else:
            tensors = _whole(param, rule, names, group, tp_rank, tp, geometry)
        for piece in unit.pieces:
            tensor = tensors[piece.name]
            if tuple(tensor.shape) != piece.local_shape():
                raise AssertionError(f"{piece.name}: a piece of shape {tuple(tensor.shape)}, declared "
                                     f"{piece.local_shape()}")
            yield piece.name, tensor


@torch.no_grad()
def full_tensors(chunks: list, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Each HF tensor this rank owns, whole (a split one gathered over its owners), in ``piece_layout`` order."""
    for unit, (param, rule, names, group, tp_rank, tp), geometry in _owned(chunks, spec):
        tensors = _whole(param, rule, names, group, tp_rank, tp, geometry)
        for piece in unit.pieces:
            yield piece.name, tensors[piece.name]


def _whole(param, rule, names, group, tp_rank: int, tp: int, geometry) -> dict[str, torch.Tensor]:
    """The parameter's HF tensors, whole: gathered over the TP group (a collective) where it is split."""
    if param.partition_dim is None or tp == 1:
        return to_hf(rule, param.tensor.detach(), names, geometry, 1)
    return to_hf(rule, gather_tp(param, group, tp_rank, tp), names, geometry, tp)


def bytes_held(layout: list[Piece]) -> dict[int, int]:
    """{rank: bytes of the pieces it hands over} for a ``piece_layout``."""
    held: dict[int, int] = defaultdict(int)
    for piece in layout:
        for owner in piece.owners:
            held[owner] += piece.local_nbytes
    return dict(held)

"""A sharded Megatron model as each rank's own pieces of the HF tensors, and where every piece lies.

``export.py`` gathers every tensor whole; an engine that reshards on its side (vLLM 0.33's ``nccl_m2n`` and
``sharded_rdt`` weight-transfer backends, see ``rlmega.rollout.vllm_weight_source``) wants the opposite: every
HF tensor declared once with its full shape and the trainer ranks that hold it, and each of those ranks handing
over only its piece, with no gather. This module is that declaration and those pieces.

Each HF tensor is owned by the ranks of the tensor-parallel group that holds its parameter (its expert-TP group
for an expert; one rank without TP), in TP order, and is either held whole by each of them (norms, routers, a
replicated weight) or split along one dimension, rank r holding chunk r of ``torch.chunk``'s split: a row- or
column-parallel weight, q, k and v of a fused QKV (TP ranks own whole query groups, so each projection's rows
split evenly), gate and up of a fused ``linear_fc1``, and the embedding and LM head. Megatron pads the
vocabulary, so its slices are not the chunks of the unpadded HF tensor: each rank takes the few rows its chunk
starts with from the ranks before it (``_rechunked_vocab``), which is no gather. Only data-parallel replica 0
(with its context-parallel ranks) owns anything, as in the export.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from rlmega.bridge.export import announce_units, gather_tp, planned
from rlmega.bridge.mapping import QKV, VOCAB, Geometry, to_hf
from rlmega.bridge.params import geometry_of
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
    """The dimension split over ``owners`` as ``torch.chunk`` splits it (owner i holds chunk i), or None: each
    owner holds it whole."""

    def rows(self, index: int) -> tuple[int, int]:
        """``[start, stop)`` along ``split_dim`` of owner ``index``'s chunk (empty past the last chunk, as
        ``torch.chunk`` returns fewer chunks than asked when the length is small)."""
        length = self.shape[self.split_dim]
        size = -(-length // len(self.owners))
        return min(index * size, length), min((index + 1) * size, length)

    def local_shape(self, index: int) -> tuple[int, ...]:
        """The shape of owner ``index``'s piece."""
        if self.split_dim is None:
            return self.shape
        start, stop = self.rows(index)
        shape = list(self.shape)
        shape[self.split_dim] = stop - start
        return tuple(shape)

    def local_nbytes(self, index: int) -> int:
        return torch.Size(self.local_shape(index)).numel() * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One Megatron parameter's pieces (q, k, v of a fused QKV; gate and up of a ``linear_fc1``)."""

    canonical: str
    pieces: tuple[Piece, ...]


def _rechunked_vocab(piece: Piece, param, group, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of an unpadded vocabulary, from the padded slices Megatron's TP ranks
    hold: each rank's chunk starts at or before its own slice, so it takes its missing rows from the ranks
    before it (point to point, a few rows each; no gather)."""
    start, stop = piece.rows(tp_rank)
    ranks = dist.get_process_group_ranks(group)
    local = param.tensor.detach()
    out = torch.empty((stop - start, *local.shape[1:]), dtype=local.dtype, device=local.device)
    requests, slice_rows = [], local.shape[0]
    for source in range(tp):  # what this rank receives, and from whom
        held = source * slice_rows, (source + 1) * slice_rows
        lo, hi = max(start, held[0]), min(stop, held[1])
        if lo < hi:
            if source == tp_rank:
                out[lo - start : hi - start] = local[lo - held[0] : hi - held[0]]
            else:
                requests.append(dist.irecv(out[lo - start : hi - start], src=ranks[source]))
    held = tp_rank * slice_rows, (tp_rank + 1) * slice_rows
    for target in range(tp):  # what this rank sends, and to whom
        wanted = piece.rows(target)
        lo, hi = max(wanted[0], held[0]), min(wanted[1], held[1])
        if target != tp_rank and lo < hi:
            requests.append(dist.isend(local[lo - held[0] : hi - held[0]].contiguous(), dst=ranks[target]))
    for request in requests:
        request.wait()
    return out


def _piece_unit(canonical: str, entry: tuple, full: dict, geometry: Geometry) -> _Unit:
    param, rule, _, group, _, tp = entry
    # Every rank of the TP group holds the tensor, split or whole.
    owners = tuple(dist.get_process_group_ranks(group)) if tp > 1 else (dist.get_rank(),)
    split_dim = None
    if param.partition_dim is not None and tp > 1:  # q/k/v and gate/up split by rows, like the fused tensor
        split_dim = 0 if rule.transform in (QKV, VOCAB) or len(full) > 1 else param.partition_dim
    return _Unit(canonical, tuple(Piece(name, t.dtype, tuple(t.shape), owners, split_dim) for name, t in full.items()))


def _layer_of(name: str) -> Optional[tuple[str, int]]:
    """``(prefix, index)`` of the name's outermost numbered segment (``model.layers.3.mlp.experts.7...``: layer 3)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else (".".join(parts[:index]), int(parts[index]))


def in_layer_order(units: list[_Unit]) -> list[_Unit]:
    """``units`` in the order vLLM 0.33's layer-by-layer transfer requires of a source's metadata
    (``layerwise_groups`` in vllm/distributed/weight_transfer/base.py): what comes before the first numbered
    layer (the embedding), then each layer whole (its experts included; stacks by first appearance, layers by
    index), then the rest (final norm, LM head). The export announces experts after the dense parameters, so
    without this a MoE layer would be split in two. Stable within a layer."""
    keys, stacks = [], {}
    for unit in units:
        layer = _layer_of(unit.pieces[0].name)
        if layer is None:
            keys.append((1 if stacks else -1, 0, 0))  # after the first numbered layer: the tail
        else:
            stacks.setdefault(layer[0], len(stacks))
            keys.append((0, stacks[layer[0]], layer[1]))
    return [units[i] for i in sorted(range(len(units)), key=keys.__getitem__)]


def _announce(exported: dict, spec: ModelSpec) -> list[_Unit]:
    # Every rank orders the same list the same way, so each TP group still meets its gathers in one order.
    return in_layer_order(announce_units(exported, spec, _piece_unit))


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


def _pieces_of(unit: _Unit, entry: tuple, geometry: Geometry) -> dict[str, torch.Tensor]:
    """This rank's piece of each of ``unit``'s HF tensors, from its parameter's export entry (any data-parallel
    replica: a replica holds what the owner at its TP position holds). The vocabulary's rows are exchanged with
    the other ranks of the entry's TP group, which must convert the same unit in the same order."""
    param, rule, names, group, tp_rank, tp = entry
    if unit.pieces[0].split_dim is None:
        tensors = _whole(param, rule, names, group, tp_rank, tp, geometry)
    elif rule.transform == VOCAB:
        tensors = {unit.pieces[0].name: _rechunked_vocab(unit.pieces[0], param, group, tp_rank, tp)}
    else:  # this rank's own rows: the fused tensor's local query groups
        local = dataclasses.replace(geometry, num_query_groups=geometry.num_query_groups // tp)
        tensors = to_hf(rule, param.tensor.detach(), names, local, 1)
    for piece in unit.pieces:
        shape = piece.local_shape(tp_rank) if piece.split_dim is not None else piece.shape
        if tuple(tensors[piece.name].shape) != shape:
            raise AssertionError(f"{piece.name}: a piece of shape {tuple(tensors[piece.name].shape)}, declared {shape}")
    return tensors


@torch.no_grad()
def local_pieces(chunks: list, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's piece of each HF tensor it owns, in ``piece_layout`` order.

    Every rank iterates to the end: the TP ranks exchange the rows of the vocabulary's chunks."""
    for unit, entry, geometry in _owned(chunks, spec):
        tensors = _pieces_of(unit, entry, geometry)
        for piece in unit.pieces:
            yield piece.name, tensors[piece.name]


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
        for index, owner in enumerate(piece.owners):
            held[owner] += piece.local_nbytes(index)
    return dict(held)

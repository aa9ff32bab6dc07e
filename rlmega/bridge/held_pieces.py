"""Every copy of the HF tensors' pieces in a sharded Megatron model, not only data-parallel replica 0's.

``pieces.piece_layout`` names one owner set per tensor (replica 0), as an engine that pulls from one copy wants.
A transfer where every copy sends a share (``rlmega.sync.transfer_plan``) needs all of them: ``placed_layout`` is
the built model's layout with each piece's replicas (the same positions in the other data-parallel replicas, or
for an expert the other expert-data-parallel replicas: ``layout_pieces.replicas_of``), and ``held_pieces`` yields
this rank's piece of every tensor it holds a copy of, converted as ``pieces.local_pieces`` converts the owners'.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from rlmega.bridge.export import planned
from rlmega.bridge.layout_pieces import PlacedPiece, replicas_of
from rlmega.bridge.mapping import RuleBook
from rlmega.bridge.params import geometry_of, local_params, tp_group_of
from rlmega.bridge.pieces import Piece, _announce, _pieces_of, piece_layout
from rlmega.models.spec import ModelSpec
from rlmega.parallel.layout import ParallelLayout


def _held_params(chunks: list, spec: ModelSpec) -> dict:
    """{canonical: (param, rule, hf names, TP group, TP rank, TP size)} of every parameter here, any replica."""
    book = RuleBook(spec.architecture)
    held = {}
    for param in local_params(chunks):
        if not param.tied_output:  # the same tensor as the input embedding
            rule, names = book.resolve(param.canonical)
            held[param.canonical] = (param, rule, names, *tp_group_of(param))
    return held


def placed_layout(chunks: list, spec: ModelSpec, layout: ParallelLayout) -> list[PlacedPiece]:
    """``piece_layout`` with every piece's replicas; the same list on every rank. Collective (the ranks tell each
    other which of their parameters are experts)."""
    pieces = piece_layout(chunks, spec)
    _, units = planned(chunks, spec, _announce)
    mine = {param.canonical for param in local_params(chunks) if param.is_expert}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    experts = set().union(*everyone)
    expert_of = {piece.name: unit.canonical in experts for unit in units for piece in unit.pieces}
    return [PlacedPiece(piece, replicas_of(piece.owners, layout, expert=expert_of[piece.name]), expert_of[piece.name])
            for piece in pieces]


@torch.no_grad()
def held_pieces(chunks: list, spec: ModelSpec) -> Iterator[tuple[Piece, int, torch.Tensor]]:
    """``(piece, this rank's position among the piece's owners, its piece)`` for every piece this rank holds a
    copy of, in ``piece_layout`` order. A rank holds chunk ``position`` of a split piece (``Piece.rows``) and the
    whole of any other. Every rank iterates to the end: the TP ranks of each replica exchange the rows of the
    vocabulary's chunks."""
    geometry = geometry_of(spec)
    _, units = planned(chunks, spec, _announce)
    held = _held_params(chunks, spec)
    for unit in units:
        entry = held.get(unit.canonical)
        if entry is None:
            continue
        tensors = _pieces_of(unit, entry, geometry)
        for piece in unit.pieces:
            yield piece, entry[4], tensors[piece.name]

"""The sliced weight transfer as a plan: which training rank sends which block of which HF tensor to which engine
rank, over which link, in what order. The planner predicts a refit from it (``rlmega.plan.sliced_refit``); a
transport that moves the weights follows the same messages, so the prediction and the run cannot drift.

Inputs: where each HF tensor lies on the training ranks (``rlmega.bridge.layout_pieces``: owners and their
identical replicas), what each engine rank holds (``rlmega.rollout.engine_bytes.held_region``: vLLM's and
SGLang's split), and where every rank runs (``Placement``: training rank r on GPU r; engines on the training GPUs
from GPU 0, or after them).

For each tensor, each engine and each engine rank holding a region of it, the region's intersection with each
training owner's chunk is one message (a 2-D block where a chunk split on rows meets a slice of columns). The
chunk can come from any copy of it: the same owner position in every replica (data-parallel, context-parallel,
expert-data-parallel), and, for a tensor each TP rank holds whole, every TP rank of them. The sender is the copy on
the receiver's own GPU, else one on its node, else one of all, rotating over receivers and tensors so that the
replicas share the sending (``replicas=False``: replica 0 only, as vLLM's ``sharded_rdt`` pulls). Links: ``self``
(the same GPU), ``nvlink`` (the same node), ``network`` (another node).

Order: the pieces' (embedding, each layer whole, the rest; ``piece_layout``'s), then engine, engine rank, chunk.
``traffic`` sums the messages per link kind and per GPU without listing them (DeepSeek-V3 on 256 GPUs makes
about 11 million): tensors that share a shape, a split and a set of copies share their messages' pattern.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Optional

import numpy as np

from rlmega.bridge.layout_pieces import PlacedPiece
from rlmega.rollout.engine_bytes import EXPERT_COLUMN, EXPERT_ROW, Box, EngineLayout, HFTensor, held_region, hf_tensors

SELF, NVLINK, NETWORK = "self", "nvlink", "network"
LINKS = (SELF, NVLINK, NETWORK)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every rank runs: training rank r on GPU r, engine e's rank i on ``engine_gpus[e][i]``."""

    engine_gpus: tuple[tuple[int, ...], ...]
    gpus_per_node: int

    @classmethod
    def of(cls, *, num_engines: int, engine_size: int, gpus_per_node: int, colocated: bool,
           training_world: int) -> "Placement":
        """Engines packed onto the training GPUs from GPU 0 (colocated), or onto the GPUs after them."""
        start = 0 if colocated else training_world
        return cls(tuple(tuple(range(start + e * engine_size, start + (e + 1) * engine_size))
                         for e in range(num_engines)), gpus_per_node)

    def link(self, sender: int, receiver: int) -> str:
        if sender == receiver:
            return SELF
        return NVLINK if sender // self.gpus_per_node == receiver // self.gpus_per_node else NETWORK


@dataclasses.dataclass(frozen=True)
class Message:
    """One block of one tensor from one training rank to one engine rank."""

    sender: int
    """Training rank (and its GPU)."""
    engine: int
    engine_rank: int
    receiver: int
    """The engine rank's GPU."""
    tensor: str
    box: Box
    """Per dimension of the full HF tensor, ``[start, stop)``."""
    nbytes: int
    """At the engine's dtype."""
    link: str


@dataclasses.dataclass
class Traffic:
    """The plan's messages summed: per link kind, and per GPU what it sends and receives over each."""

    link_messages: dict[str, int]
    link_bytes: dict[str, int]
    sent_bytes: np.ndarray
    """[GPUs, len(LINKS)] bytes each GPU sends over each link kind."""
    received_bytes: np.ndarray
    sent_messages: np.ndarray
    """[GPUs] messages each GPU sends."""
    received_messages: np.ndarray

    @property
    def total_bytes(self) -> int:
        return sum(self.link_bytes.values())


def _intersection(a: Box, b: Box) -> Optional[Box]:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _numel(box: Box) -> int:
    count = 1
    for start, stop in box:
        count *= stop - start
    return count


def _chunk_box(placed: PlacedPiece, index: int) -> Box:
    """The block owner ``index`` of a piece holds."""
    piece = placed.piece
    box = [(0, size) for size in piece.shape]
    if piece.split_dim is not None:
        box[piece.split_dim] = piece.rows(index)
    return tuple(box)


def _pattern_key(placed: PlacedPiece, tensor: HFTensor, layout: EngineLayout) -> tuple:
    """What a tensor's messages to one engine depend on: its shape, the training split, the engine's split, and
    for an expert which engine ranks hold it."""
    group = -1
    if tensor.split in (EXPERT_COLUMN, EXPERT_ROW):
        group = tensor.expert // (tensor.num_experts // layout.expert_parallel_size)
    piece = placed.piece
    return piece.shape, piece.split_dim, len(piece.owners), tensor.split, tensor.num_kv_heads, group


@dataclasses.dataclass
class TransferPlan:
    pieces: list[PlacedPiece]
    """The tensors the engines load, in the transfer's order."""
    tensors: list[HFTensor]
    """The engines' view of each (``pieces[i]`` is ``tensors[i]``)."""
    layout: EngineLayout
    placement: Placement
    replicas: bool
    """Whether every replica sends (False: data-parallel replica 0 alone)."""
    not_loaded: list[str]
    """Training tensors no engine loads (DeepSeek-V3's MTP layers)."""
    _patterns: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_gpus(self) -> int:
        training = max(owner for placed in self.pieces for replica in placed.replicas for owner in replica) + 1
        return max(training, max(max(gpus) for gpus in self.placement.engine_gpus) + 1)

    def _copies(self, placed: PlacedPiece) -> tuple[tuple[int, ...], ...]:
        """Per owner index, every rank that holds its chunk: the same position in each replica; for a piece each
        owner holds whole, one entry with every owner of every replica."""
        replicas = placed.replicas if self.replicas else placed.replicas[:1]
        if placed.piece.split_dim is None:
            return (tuple(owner for replica in replicas for owner in replica),)
        return tuple(tuple(replica[index] for replica in replicas) for index in range(len(placed.piece.owners)))

    def _pattern(self, index: int) -> tuple[tuple[int, int, Box], ...]:
        """(owner index, engine rank, block) of every message of ``pieces[index]`` to one engine, engine rank by
        engine rank; shared by every tensor with the same key."""
        placed, tensor = self.pieces[index], self.tensors[index]
        key = _pattern_key(placed, tensor, self.layout)
        if key not in self._patterns:
            # A piece each owner holds whole is one chunk (any owner's copy of it, see _copies).
            split = placed.piece.split_dim is not None
            chunks = [_chunk_box(placed, owner) for owner in range(len(placed.piece.owners) if split else 1)]
            pattern = []
            for rank in range(self.layout.world_size):
                region = held_region(tensor, self.layout, rank)
                for owner, chunk in enumerate(chunks if region is not None else ()):
                    box = _intersection(chunk, region)
                    if box is not None:
                        pattern.append((owner, rank, box))
            self._patterns[key] = tuple(pattern)
        return self._patterns[key]

    def _sender(self, copies: tuple[int, ...], receiver: int, turn: int) -> int:
        """The copy on the receiver's GPU, else one on its node, else any; ``turn`` rotates the choice over
        receivers and tensors, so that the replicas share the sending (only ``turn % len(copies)`` counts)."""
        if receiver in copies:
            return receiver
        node = receiver // self.placement.gpus_per_node
        near = [gpu for gpu in copies if gpu // self.placement.gpus_per_node == node]
        choices = near or copies
        return choices[(turn % len(copies)) % len(choices)]

    def _routed(self, index: int, copies, turn: int) -> Iterator[tuple[int, int, int, int, Box]]:
        """(engine, engine rank, sender, receiver, block) of every message of ``pieces[index]``."""
        engine_world = self.layout.world_size
        pattern = self._pattern(index)
        for engine, gpus in enumerate(self.placement.engine_gpus):
            for owner, rank, box in pattern:
                receiver = gpus[rank]
                sender = self._sender(copies[owner if len(copies) > 1 else 0], receiver,
                                      engine * engine_world + rank + turn)
                yield engine, rank, sender, receiver, box

    def messages(self) -> Iterator[Message]:
        """Every message, in the transfer's order."""
        for index in range(len(self.pieces)):
            yield from self.messages_of(index)

    def messages_of(self, index: int) -> Iterator[Message]:
        """The messages of ``pieces[index]``, in the transfer's order."""
        placed = self.pieces[index]
        for engine, rank, sender, receiver, box in self._routed(index, self._copies(placed), index):
            yield Message(sender, engine, rank, receiver, placed.piece.name, box,
                          _numel(box) * self.layout.dtype_bytes, self.placement.link(sender, receiver))

    def buckets(self, bucket_bytes: int) -> list[range]:
        """The pieces in consecutive runs of at most ``bucket_bytes`` (whole tensors at the engine's dtype; a larger
        tensor alone): what a transport moves at a time, the same runs on every rank."""
        runs, start, size = [], 0, 0
        for index, tensor in enumerate(self.tensors):
            nbytes = tensor.numel * self.layout.dtype_bytes
            if index > start and size + nbytes > bucket_bytes:
                runs.append(range(start, index))
                start, size = index, 0
            size += nbytes
        if start < len(self.tensors):
            runs.append(range(start, len(self.tensors)))
        return runs

    @functools.cached_property
    def traffic(self) -> Traffic:
        """``messages()`` summed without listing them: tensors with the same pattern, copies and turn (the turn
        only matters modulo the number of copies) send the same blocks between the same GPUs."""
        groups: dict = {}
        for index, placed in enumerate(self.pieces):
            copies = self._copies(placed)
            key = (_pattern_key(placed, self.tensors[index], self.layout), copies, index % len(copies[0]))
            first, count = groups.get(key, (index, 0))
            groups[key] = (first, count + 1)
        gpus = self.num_gpus
        sent, received = np.zeros((gpus, len(LINKS)), np.int64), np.zeros((gpus, len(LINKS)), np.int64)
        sent_messages, received_messages = np.zeros(gpus, np.int64), np.zeros(gpus, np.int64)
        link_messages = np.zeros(len(LINKS), np.int64)
        for (_, copies, turn), (first, count) in groups.items():
            for _, _, sender, receiver, box in self._routed(first, copies, turn):
                link = LINKS.index(self.placement.link(sender, receiver))
                nbytes = _numel(box) * self.layout.dtype_bytes * count
                sent[sender, link] += nbytes
                received[receiver, link] += nbytes
                sent_messages[sender] += count
                received_messages[receiver] += count
                link_messages[link] += count
        return Traffic({link: int(link_messages[i]) for i, link in enumerate(LINKS)},
                       {link: int(sent[:, i].sum()) for i, link in enumerate(LINKS)},
                       sent, received, sent_messages, received_messages)


def plan_transfer(pieces: list[PlacedPiece], hf_config: dict, layout: EngineLayout, placement: Placement, *,
                  replicas: bool = True) -> TransferPlan:
    """The transfer of the training ``pieces`` (``layout_pieces.placed_pieces``) into ``len(placement.engine_gpus)``
    engines of ``layout``, for the HF model ``hf_config`` describes."""
    by_name = {placed.piece.name: placed for placed in pieces}
    engine = {tensor.name: tensor for tensor in hf_tensors(hf_config)}
    missing = [name for name in engine if name not in by_name]
    if missing:
        raise ValueError(f"the engines load {missing[0]} (and {len(missing) - 1} more), which the training layout "
                         "does not hold; the HF config and the training model disagree")
    for gpus in placement.engine_gpus:
        if len(gpus) != layout.world_size:
            raise ValueError(f"an engine of {len(gpus)} GPUs for an engine layout of {layout.world_size} ranks")
    loaded = [placed for placed in pieces if placed.piece.name in engine]
    for placed in loaded:
        if tuple(engine[placed.piece.name].shape) != placed.piece.shape:
            raise ValueError(f"{placed.piece.name}: the engines hold shape {engine[placed.piece.name].shape}, "
                             f"the training ranks {placed.piece.shape}")
    return TransferPlan(loaded, [engine[placed.piece.name] for placed in loaded], layout, placement, replicas,
                        [placed.piece.name for placed in pieces if placed.piece.name not in engine])

"""The ``sliced`` transport: the transfer plan (``rlmega.sync.transfer_plan``) carried out. Every training rank
sends, in parallel, only the blocks the plan gives it, straight to the engine ranks that hold them; nothing is
gathered to rank 0, and each engine rank receives only its own region of each tensor.

Both ends work from the same ``TransferPlan``, so nothing but the data crosses the wire: the training ranks and the
engine ranks (one ``SlicedReceiver`` each, iterated in the engine rank's process) form a process group of their
own (gloo on CPU, NCCL on GPU; training rank r is group rank r, engine e's rank i comes after them), built on a
store that training rank 0 serves, and kept from one update to the next. The pieces go in buckets
(``TransferPlan.buckets``); per bucket, a sender packs its blocks for each receiver into one flat buffer and
sends it, and a receiver takes one buffer from each of its senders, whose size it knows from the plan. A sender
has at most two buckets in flight, and a receiver posts bucket n+1 before handing bucket n to its engine, so
converting, sending and loading overlap.

Each end counts the bytes it moved per link kind of the plan (``self``, ``nvlink``, ``network``): the run's
counts, which ``tests/sync/test_sliced.py`` holds equal to the plan's ``traffic``.

Failure: a training rank that fails posts the reason on the store; every receiver checks for it while it waits
and fails its engine's update, which then commits nothing (the engine refuses to generate until a later update
lands); a receiver that fails reports it, and the training ranks raise ``TransportError``. Every wait is bounded
by ``timeout_s``. A failed update drops the group on every side; the next one builds it afresh.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from rlmega.bridge.held_pieces import held_pieces, placed_layout
from rlmega.models.spec import ModelSpec
from rlmega.parallel.layout import ParallelLayout
from rlmega.rollout.engine_bytes import Box, EngineLayout, held_region
from rlmega.sync.broadcast import store_group
from rlmega.sync.config import SLICED
from rlmega.sync.control import POLL_MAX_S, POLL_MIN_S, Address, Channel, Watch, report_failure
from rlmega.sync.errors import TransportError
from rlmega.sync.sliced_in_node import StoreWait, receive_in_node, send_in_node
from rlmega.sync.stats import SyncStats
from rlmega.sync.transfer_plan import LINKS, NETWORK, Placement, TransferPlan, plan_transfer
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, in_thread, start_update



def _slices(box: Box, origin: Sequence[int] = ()) -> tuple[slice, ...]:
    origin = tuple(origin) or (0,) * len(box)
    return tuple(slice(start - base, stop - base) for (start, stop), base in zip(box, origin))


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _engine_group_rank(plan: TransferPlan, training_world: int, engine: int, rank: int) -> int:
    return training_world + engine * plan.layout.world_size + rank


class _Poll:
    """Bounded waits that also watch for a failure: one posted on the store by a training rank (``abort``), and on
    training rank 0 the engines' update calls and the receivers' reports (``watch``)."""

    def __init__(self, channel: Channel, prefix: str, timeout_s: float, watch: Optional[Watch] = None):
        self.channel, self.prefix, self.timeout_s, self.watch = channel, prefix, timeout_s, watch

    def check(self) -> None:
        if self.watch is not None:
            self.watch.check()
        reason = self.channel.peek(f"{self.prefix}abort")
        if reason is not None:
            raise TransportError(f"the update was aborted: {reason}")

    def until(self, ready, what: str) -> None:
        deadline, pause = time.monotonic() + self.timeout_s, POLL_MIN_S
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise TransportError(f"timed out after {self.timeout_s:g} s waiting for {what}")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)

    def works(self, works: list, what: str) -> None:
        """Wait for process-group works and in-node transfers (``StoreWait``) alike."""
        in_node = [work for work in works if isinstance(work, StoreWait)]
        # gloo's point-to-point works complete only inside wait(): each is waited for on a thread of its own.
        waits = [in_thread(work.wait) for work in works if not isinstance(work, StoreWait)]
        self.until(lambda: all(wait.done() for wait in waits) and all(work.ready() for work in in_node), what)
        for wait in waits:
            if wait.exception() is not None:  # a peer left: say why, if a training rank posted it
                self.check()
                raise TransportError(f"{what} failed: {wait.exception()}") from wait.exception()
        for work in in_node:
            try:
                work.finish()
            except Exception as error:  # a buffer its sender let go of on an abort: say why, if one was posted
                self.check()
                raise TransportError(f"{what} failed: {type(error).__name__}: {error}") from error


class SlicedTransport:
    """This training rank's side of the ``sliced`` transport; collective over the training ranks (the job's
    default group). ``plan`` is the same on every rank (``transfer_plan.plan_transfer`` of ``placed_layout``);
    ``engines`` (rank 0 only, else None): engines of one rank each, updated through ``start_update``; without
    them, rank 0 hands ``listen()``'s receivers to the engine ranks itself before each ``push``. ``dtype``: the
    engines' (its size is the plan's ``dtype_bytes``)."""

    name = SLICED

    def __init__(self, chunks: list, spec: ModelSpec, plan: TransferPlan, engines: Optional[Sequence] = None, *,
                 dtype: torch.dtype, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str = "127.0.0.1", backend: Optional[str] = None):
        if dtype.itemsize != plan.layout.dtype_bytes:
            raise ValueError(f"the plan moves {plan.layout.dtype_bytes}-byte elements, the engines hold {dtype}")
        self.chunks, self.spec, self.plan, self.dtype = chunks, spec, plan, dtype
        self.timeout_s, self.host = timeout_s, host
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.engines = list(engines) if engines is not None else None
        if self.engines and plan.layout.world_size != 1:
            raise ValueError("an engine of several ranks takes one receiver per rank: call listen() and hand each "
                             "rank its own")
        self.buckets = plan.buckets(bucket_bytes)
        self.held_pieces = held_pieces
        """What yields this rank's pieces (``rlmega.bridge.held_pieces``; a check may wrap it to fail on purpose)."""
        self.sent = dict.fromkeys(LINKS, 0)
        """Bytes this rank sent over each link kind, over every update."""
        self._channel: Optional[Channel] = None
        self._address: Optional[Address] = None
        self._group = None
        self._update = 0
        self._listened = False
        self._failed = False
        self._outstanding: list = []  # in-node buffers not yet acknowledged

    @property
    def receiver_count(self) -> int:
        return len(self.plan.placement.engine_gpus) * self.plan.layout.world_size

    def listen(self) -> list[list["SlicedReceiver"]]:
        """Rank 0: start the next update; per engine, one receiver per engine rank, each to be iterated in that
        rank's process (``update_weights(receiver, version)``)."""
        if self.rank != 0:
            raise RuntimeError("listen() is training rank 0's: it serves the store the receivers reach")
        if self._channel is None or self._failed:
            self._channel, self._address = Channel.serve(self.host, self.timeout_s)
            self._group, self._failed = None, False
        elif self._update:
            self._channel.forget(f"{self._update}/commit")  # every receiver of that update has read it by now
        self._update += 1
        self._listened = True
        world = self.world + self.receiver_count
        return [[SlicedReceiver(self._address, self._update, self.plan, self.buckets, engine, rank,
                                _engine_group_rank(self.plan, self.world, engine, rank), world, self.dtype, self.backend)
                 for rank in range(self.plan.layout.world_size)] for engine in range(len(self.plan.placement.engine_gpus))]

    def push(self, version: int) -> SyncStats:
        """Send this rank's blocks of every bucket; on rank 0, returns once every engine rank has received all
        of its blocks (and every engine given has committed ``version``)."""
        started, futures = time.perf_counter(), []
        if self.rank == 0 and self.engines is not None:
            futures = [start_update(engine, receivers[0], version) for engine, receivers in zip(self.engines, self.listen())]
        if self.rank == 0 and not self._listened:
            raise RuntimeError("call listen() and hand out its receivers before push()")
        self._listened = False
        shared = [self._address, self._update]
        dist.broadcast_object_list(shared, src=0)
        address, update = shared
        if address != self._address or self._channel is None:
            self._group = None
            self._channel, self._address = Channel.connect(address), address
        prefix = f"{update}/"
        watch = Watch(futures, self.timeout_s, self._channel, prefix)
        moved = {"tensors": 0, "bytes": 0}
        failure: Optional[BaseException] = None
        try:
            self._send(_Poll(self._channel, prefix, self.timeout_s, watch), moved)
        except BaseException as error:  # noqa: BLE001 - told to the receivers and the other ranks, then raised
            failure = error
            self._abort(prefix, f"training rank {self.rank}: {type(error).__name__}: {error}", watch)
        # The engines commit all or none: each rank says how its sending went, and the receivers wait for the
        # commit that rank 0 posts only when every rank sent everything.
        outcomes: list = [None] * self.world
        dist.all_gather_object(outcomes, None if failure is None else f"training rank {self.rank}: "
                                                                      f"{type(failure).__name__}: {failure}")
        failed = [outcome for outcome in outcomes if outcome]
        try:
            if failed:
                if failure is None:
                    self._abort(prefix, failed[0], watch)
                raise TransportError(f"sliced weight transfer failed: {failed[0]}") from failure
            if self.rank == 0:
                done = [f"{prefix}done/{_engine_group_rank(self.plan, self.world, e, r)}"
                        for e in range(len(self.plan.placement.engine_gpus)) for r in range(self.plan.layout.world_size)]
                # Polled (a blocking wait on the store logs each time it runs out).
                watch.until(lambda: self._channel.has(done), "the engine ranks to receive every block", finishing=True)
                self._channel.post(f"{prefix}commit", None)
                self._channel.forget(*done)
                watch.finish()
        except BaseException as error:
            if not failed:
                self._abort(prefix, f"training rank {self.rank}: {type(error).__name__}: {error}", watch)
            # The next update starts on a new store and group, on every side (rank 0 keeps this store until then,
            # for the peers still to read the abort).
            self._group, self._failed = None, True
            if isinstance(error, TransportError):
                raise
            raise TransportError(f"sliced weight transfer failed: {error}") from error
        return SyncStats(version=version, seconds=time.perf_counter() - started,
                         transport=SLICED if self.rank == 0 else None, **moved)

    def _abort(self, prefix: str, reason: str, watch: Watch) -> None:
        """Tell the receivers the update is off (they fail their engines' updates), and let go of shared buffers."""
        try:
            self._channel.post(f"{prefix}abort", reason)
        except Exception:  # the store may be gone; the receivers then time out on their own
            pass
        watch.settle()
        for block in list(self._outstanding):
            block.release()
        self._outstanding.clear()

    def _send(self, poll: _Poll, moved: dict) -> None:
        held = self.held_pieces(self.chunks, self.spec)
        in_flight: list[tuple[list, list]] = []  # per bucket: its works, and the buffers they read
        group = self._connect(poll)
        for bucket_index, bucket in enumerate(self.buckets):
            outgoing: dict[int, list[torch.Tensor]] = {}
            links: dict[int, str] = {}
            for index in bucket:
                placed = self.plan.pieces[index]
                if not any(self.rank in replica for replica in placed.replicas):
                    continue
                # Every rank converts each piece it holds in turn, sending or not, so that the TP ranks of a
                # replica meet in the vocabulary's row exchange at the same piece.
                piece, position, tensor = next(held)
                while piece.name != placed.piece.name:  # a tensor no engine loads (an MTP layer)
                    piece, position, tensor = next(held)
                origin = [0] * len(piece.shape)
                if piece.split_dim is not None:
                    origin[piece.split_dim] = piece.rows(position)[0]
                for message in self.plan.messages_of(index):
                    if message.sender == self.rank:
                        dst = _engine_group_rank(self.plan, self.world, message.engine, message.engine_rank)
                        outgoing.setdefault(dst, []).append(tensor[_slices(message.box, origin)].to(self.dtype).reshape(-1))
                        links[dst] = message.link
                moved["tensors"] += 1
            if len(in_flight) == 2:
                poll.works(in_flight.pop(0)[0], "a bucket to reach the engine ranks")
            works, buffers = [], []
            for dst, blocks in outgoing.items():
                flat = torch.cat(blocks)
                if self.backend == "nccl":
                    flat = flat.cuda()
                if links[dst] == NETWORK:
                    works.append(group.send([flat], dst, bucket_index))
                else:  # the same node: shared memory, CUDA IPC on GPU (sliced_in_node)
                    works.append(send_in_node(self._channel, poll.prefix, bucket_index, self.rank, dst, flat,
                                              self._outstanding))
                buffers.append(flat)  # alive until the send completes
                self.sent[links[dst]] += flat.numel() * flat.element_size()
                moved["bytes"] += flat.numel() * flat.element_size()
            in_flight.append((works, buffers))
        for works, _ in in_flight:
            poll.works(works, "a bucket to reach the engine ranks")
        for _ in held:  # to the end, with the other ranks of the TP group
            pass

    def _connect(self, poll: _Poll):
        if self._group is None:
            joining = in_thread(store_group, self._channel.store, self.rank, self.world + self.receiver_count,
                                self.backend, self.timeout_s)
            poll.until(joining.done, "the engine ranks to join the sliced transfer's group")
            self._group = joining.result()
        return self._group

    def close(self) -> None:
        """Let go of the group and the store (on rank 0, which serves it, the store ends)."""
        self._group = None
        self._channel = self._address = None


# Group rank -> (address, group) an engine rank's process keeps from one update to the next.
_KEPT: dict[int, tuple[Address, Channel, object]] = {}


class SlicedReceiver:
    """One engine rank's side of an update: iterate it in that rank's process to get ``(hf_name, region)`` for each
    tensor it holds, ``region`` being its block of the tensor (the whole tensor where it holds it whole, as an engine
    of one rank does). Ends cleanly only when every block arrived; ``received`` counts the bytes per link kind."""

    def __init__(self, address: Address, update: int, plan: TransferPlan, buckets: list[range], engine: int,
                 rank: int, group_rank: int, world: int, dtype: torch.dtype, backend: str):
        self.address, self.update, self.plan, self.buckets = address, update, plan, buckets
        self.engine, self.rank, self.group_rank, self.world = engine, rank, group_rank, world
        self.dtype, self.backend = dtype, backend
        self.received = dict.fromkeys(LINKS, 0)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"{self.update}/"
        kept = _KEPT.get(self.group_rank)
        try:
            if kept is None or kept[0] != self.address:
                _KEPT.pop(self.group_rank, None)
                channel = Channel.connect(self.address)
                kept = _KEPT[self.group_rank] = (self.address, channel, store_group(
                    channel.store, self.group_rank, self.world, self.backend, self.address.timeout_s))
            _, channel, group = kept
            poll = _Poll(channel, prefix, self.address.timeout_s)
            pending = self._post(group, channel, prefix, 0)
            for bucket_index in range(len(self.buckets)):
                receives, regions = pending
                poll.works([work for work, _, _ in receives], f"bucket {bucket_index} from the training ranks")
                pending = (self._post(group, channel, prefix, bucket_index + 1)
                           if bucket_index + 1 < len(self.buckets) else None)
                self._unpack(receives, regions)
                for name, (region, _) in regions.items():
                    yield name, region
            channel.post(f"{prefix}done/{self.group_rank}", None)
            # All or none: the engine commits only once every training rank has sent everything.
            poll.until(lambda: channel.has([f"{prefix}commit"]), "the training ranks to commit the update")
        except GeneratorExit:
            _KEPT.pop(self.group_rank, None)
            raise
        except BaseException as error:
            _KEPT.pop(self.group_rank, None)
            if kept is not None:
                report_failure(kept[1], self.group_rank, error, prefix)
            raise

    def _post(self, group, channel: Channel, prefix: str, bucket_index: int) -> tuple[list, dict]:
        """Post the receives of one bucket: one flat buffer per sender, sized by the plan."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        regions: dict[str, tuple[torch.Tensor, Box]] = {}
        incoming: dict[int, list] = {}
        for index in self.buckets[bucket_index]:
            tensor = self.plan.tensors[index]
            region = held_region(tensor, self.plan.layout, self.rank)
            if region is None:
                continue
            regions[tensor.name] = (torch.empty(_shape(region), dtype=self.dtype, device=device), region)
            for message in self.plan.messages_of(index):
                if (message.engine, message.engine_rank) == (self.engine, self.rank):
                    incoming.setdefault(message.sender, []).append(message)
        receives = []
        for sender, messages in incoming.items():
            flat = torch.empty(sum(message.nbytes for message in messages) // self.dtype.itemsize, dtype=self.dtype,
                               device=device)
            if messages[0].link == NETWORK:
                receives.append((group.recv([flat], sender, bucket_index), flat, messages))
            else:  # the same node: shared memory, CUDA IPC on GPU (sliced_in_node)
                receives.append((receive_in_node(channel, prefix, bucket_index, sender, self.group_rank, flat), flat,
                                 messages))
        return receives, regions

    def _unpack(self, receives: list, regions: dict) -> None:
        covered = dict.fromkeys(regions, 0)
        for _, flat, messages in receives:
            offset = 0
            for message in messages:
                target, region = regions[message.tensor]
                numel = message.nbytes // self.dtype.itemsize
                target[_slices(message.box, [start for start, _ in region])].copy_(
                    flat[offset:offset + numel].view(_shape(message.box)))
                offset += numel
                covered[message.tensor] += numel
                self.received[message.link] += message.nbytes
        for name, (target, _) in regions.items():
            if covered[name] != target.numel():  # the plan covers every region exactly once
                raise TransportError(f"engine {self.engine} rank {self.rank} got {covered[name]} of the "
                                     f"{target.numel()} elements of {name} it holds")


@dataclasses.dataclass(frozen=True)
class SlicedSetup:
    """What a run's training rank knows of where things are, for the ``sliced`` plan."""

    layout: ParallelLayout
    """The training ranks' parallel layout."""
    hf_dir: str
    """The checkpoint whose ``config.json`` describes the model."""
    colocated: bool
    """Engines on the training GPUs (from GPU 0) or after them; it decides only how the bytes are counted per link."""
    gpus_per_node: int


def sliced_transport(chunks: list, spec: ModelSpec, setup: SlicedSetup, engines: Optional[Sequence], *,
                     bucket_bytes: int, timeout_s: float) -> SlicedTransport:
    """A run's ``sliced`` transport into ``engines`` (rank 0; None elsewhere), engines of one rank each, which take
    the model at the training weights' dtype. Collective: the plan is made on every rank alike."""
    fleet = [len(engines) if engines is not None else None]
    dist.broadcast_object_list(fleet, src=0)
    placed = placed_layout(chunks, spec, setup.layout)
    dtype = placed[0].piece.dtype
    placement = Placement.of(num_engines=fleet[0], engine_size=1, gpus_per_node=setup.gpus_per_node,
                             colocated=setup.colocated, training_world=setup.layout.world_size)
    hf_config = json.loads((Path(setup.hf_dir) / "config.json").read_text())
    plan = plan_transfer(placed, hf_config, EngineLayout(1, dtype_bytes=dtype.itemsize), placement)
    return SlicedTransport(chunks, spec, plan, engines, dtype=dtype, bucket_bytes=bucket_bytes, timeout_s=timeout_s)

"""The ``broadcast`` transport: a torch.distributed process group of its own between the trainer's
sending rank (rank 0 of the group) and the engine processes (ranks 1..N), gloo on CPU and NCCL on
GPU. Each bucket is broadcast as one flat tensor; its metadata goes first over the control channel.

The group is built from an explicit store (the sender's control store, at an explicit host and a
port the sender picks) with its own timeout, so it never touches the trainer's default group and
works from any process, a Ray actor included. It is built when the first bucket of the first update
is announced and kept, with the store and the buffers on both sides, for the next updates into the
same receivers; a failed update drops it on both sides, and the next one builds it again.

The sender double-buffers: two flat slots, the broadcast of bucket n runs asynchronously while the
caller builds bucket n+1, and a slot is reused only once its broadcast has completed.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from rlmega.sync.buckets import NamedTensors, layout, pack, unpack
from rlmega.sync.control import Address, Channel, Kept, end_stream, forget_update, receive_kept
from rlmega.sync.errors import TransportError
from rlmega.sync.store_sender import StoreSender
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, in_thread

BACKENDS = ("gloo", "nccl")


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def store_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float):
    """A process group on ``store`` alone; blocks until every rank has joined (or the timeout)."""
    store = dist.PrefixStore("group", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _broadcast_from_rank0(group, flat: torch.Tensor):
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([flat], options)


class BroadcastTransport(StoreSender):
    """Sender of the ``broadcast`` transport (see the module docstring).

    ``backend``: "gloo" or "nccl" (default: nccl where CUDA is available, else gloo). ``host`` must
    be an address of this machine that the engine processes reach (127.0.0.1 when they are here).
    """

    name = "broadcast"

    def __init__(self, *, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S, host: str = "127.0.0.1",
                 backend: Optional[str] = None):
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in BACKENDS:
            raise ValueError(f"broadcast backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(bucket_bytes=bucket_bytes, timeout_s=timeout_s, host=host)
        self.backend = backend
        self._group = None
        self._slots: list[Optional[torch.Tensor]] = [None, None]
        self._works: list = [None, None]

    def listen(self, num_receivers: int) -> list["BroadcastReceiver"]:
        """Start an update (and the control channel, on the first or after a failure); returns one
        receiver per engine process (group ranks 1..N), each to be iterated in its engine's process
        (``engine.update_weights(receiver, version)``)."""
        self._start_update(num_receivers)
        self._works = [None, None]
        return [BroadcastReceiver(self._address, rank, num_receivers + 1, self.backend, self._update)
                for rank in range(1, num_receivers + 1)]

    def send(self, bucket: NamedTensors) -> None:
        metas, nbytes = layout(bucket)
        index = self._sent
        slot = index % 2
        self._complete(slot)
        if self._slots[slot] is None or self._slots[slot].numel() < nbytes:
            self._slots[slot] = None
            self._slots[slot] = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=_device(self.backend))
        flat = self._slots[slot][:nbytes]
        pack(bucket, metas, flat)
        self._channel.post(f"{self._prefix}bucket/{index}", ("bucket", nbytes, metas))
        self._works[slot] = _broadcast_from_rank0(self._connect(), flat)  # receivers join on the first bucket
        self._sent += 1

    def finish(self) -> None:
        self._complete(self._sent % 2)
        self._complete((self._sent + 1) % 2)
        ranks = range(1, self._num_receivers + 1)
        end_stream(self._channel, self._watch, self._sent, ranks, self._prefix)
        forget_update(self._channel, self._prefix, ranks, self._sent)

    def release(self) -> None:
        """Drop the group, the buffers and the control store."""
        self._group = None
        self._works = [None, None]
        self._slots = [None, None]
        self._channel = self._address = None

    def _connect(self):
        if self._group is None:
            joining = in_thread(store_group, self._channel.store, 0, self._num_receivers + 1, self.backend, self.timeout_s)
            self._watch.until(joining.done, "the receivers to join the broadcast group")
            self._group = joining.result()
        return self._group

    def _complete(self, slot: int) -> None:
        work = self._works[slot]
        if work is None:
            return
        self._watch.until(work.is_completed, "a broadcast to reach the receivers")
        self._works[slot] = None
        try:
            work.wait()
        except Exception as error:
            raise TransportError(f"broadcast to the engines failed: {error}") from error


@dataclasses.dataclass(frozen=True)
class BroadcastReceiver:
    """The receiving side: iterate it in the engine's process to get the update's ``(hf_name, tensor)``.

    Joins the group as ``rank`` (on the sender's first update; later ones reuse it), receives each
    bucket into a buffer it reuses and yields views of it (valid until the next one is requested).
    Ends cleanly only at the sender's end of stream; raises ``TransportError`` if the sender aborts,
    and the group's own error if a peer goes away.
    """

    address: Address
    rank: int
    world_size: int
    backend: str
    update: int = 1

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        # The group and the buffer stay in this process for the sender's next update (``receive_kept``);
        # a failure drops them, which leaves the group at once (a sender still broadcasting fails).
        def take_bucket(kept: Kept, channel: Channel, index: int, payload: tuple):
            nbytes, metas = payload
            state = kept.state
            if "group" not in state:
                state["group"] = store_group(channel.store, self.rank, self.world_size, self.backend, self.address.timeout_s)
            if state.get("buffer") is None or state["buffer"].numel() < nbytes:
                state["buffer"] = None
                state["buffer"] = torch.empty(nbytes, dtype=torch.uint8, device=_device(self.backend))
            flat = state["buffer"][:nbytes]
            _broadcast_from_rank0(state["group"], flat).wait()
            yield from unpack(flat, metas)

        return receive_kept(self.address, self.rank, self.update, take_bucket)

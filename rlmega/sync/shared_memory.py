"""The ``shared_memory`` transport: the sender writes each bucket into a reusable region that the
engine's process maps too, and sends only metadata (names, dtypes, shapes, offsets) over the
control channel; the receiver hands views of the region to the engine, which copies them in.

On CPU the region is a file in /dev/shm mapped by both processes. On GPU it is device memory shared
through CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``), chosen when the buckets are
CUDA tensors; it needs the engine in another process on the same GPU node.

The region has two slots, so the sender packs bucket n+1 while the engine copies bucket n; a bucket
larger than a slot (one large tensor) replaces the region with a larger one once the receivers are
done with the old. The region's name is unlinked as soon as every receiver has mapped it (and
again, if need be, on release): after that, nothing is left in /dev/shm even if a process is killed.
The control store, the region and the receivers' connections and mappings stay from one update to
the next, so a sync after the first creates nothing.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Iterator, Optional, Sequence

import torch

from rlmega.parallel.shm import create_region, map_region
from rlmega.sync.buckets import ALIGN_BYTES, NamedTensors, layout, pack, unpack
from rlmega.sync.control import Address, Channel, Kept, end_stream, forget_update, receive_kept
from rlmega.sync.store_sender import StoreSender
from rlmega.sync.transports import DEFAULT_TIMEOUT_S

SHM_PREFIX = "rlmega-sync-"
IPC_DEVICE_ARG = 6  # torch.multiprocessing.reductions.rebuild_cuda_tensor's storage_device argument


def device_uuid(index: int) -> str:
    """The physical GPU behind this process's CUDA device ``index`` (the same in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str, uuids: Sequence[str]) -> int:
    """This process's index of the GPU named ``uuid``, among the ``uuids`` it sees (in index order).

    Ray gives each actor its own ``CUDA_VISIBLE_DEVICES``, so the same GPU has other indices in the
    trainer rank and in an engine actor on the same host; a CUDA IPC handle names it by the sender's
    index, and opening it by that index in the receiver maps the wrong device (or none).
    """
    try:
        return list(uuids).index(uuid)
    except ValueError:
        raise RuntimeError(f"the sender's GPU {uuid} is not visible in this process (it sees {list(uuids)}): "
                           f"CUDA IPC needs both processes to see it; use the broadcast or object_store "
                           f"transport") from None


@dataclasses.dataclass(frozen=True)
class RegionHandle:
    """What a receiver needs to map the sender's region: a /dev/shm path, or a CUDA IPC handle
    (``reduce_tensor``'s rebuild function and its arguments)."""

    generation: int
    nbytes: int
    path: Optional[str] = None
    cuda_ipc: Optional[tuple] = None
    device_uuid: Optional[str] = None  # of the GPU that holds a CUDA IPC region

    def open(self) -> torch.Tensor:
        if self.cuda_ipc is not None:
            rebuild, args = self.cuda_ipc
            visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
            args = list(args)
            args[IPC_DEVICE_ARG] = local_device_index(self.device_uuid, visible)
            return rebuild(*args)
        return map_region(self.path, self.nbytes)


class _Region:
    """The sender's side of a region: the tensor it packs into, and its /dev/shm name if any."""

    def __init__(self, generation: int, slot_bytes: int, device: torch.device, directory: str, first_index: int):
        self.slot_bytes = slot_bytes
        self.first_index = first_index  # the first bucket sent through it
        nbytes = 2 * slot_bytes
        self.path = None
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.handle = RegionHandle(generation, nbytes, cuda_ipc=reduce_tensor(self.tensor),
                                       device_uuid=device_uuid(self.tensor.device.index))
            return
        self.path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        self.tensor = create_region(self.path, nbytes)
        self.handle = RegionHandle(generation, nbytes, path=self.path)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


class SharedMemoryTransport(StoreSender):
    """Sender of the ``shared_memory`` transport (see the module docstring).

    ``bucket_bytes`` sizes the two slots (a larger bucket grows them); ``timeout_s`` bounds every
    wait for a receiver; ``host`` is where the control store listens (receivers are on this host).

    One transport serves update after update into the same receivers: its control store and its
    region stay (and the receivers keep their connection and mapping, ``control.receive_kept``), so an
    update after the first sets nothing up. A failed update releases both; the next one starts afresh.
    """

    name = "shared_memory"

    def __init__(self, *, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str = "127.0.0.1", directory: str = "/dev/shm"):
        super().__init__(bucket_bytes=bucket_bytes, timeout_s=timeout_s, host=host)
        self.directory = directory
        self._region: Optional[_Region] = None
        self._generation = 0  # grows over the transport's life, so a receiver never confuses two regions
        self._base = 0  # buckets sent in earlier updates (a region's first bucket counts over the whole life)
        self._acked = -1  # every bucket of this update up to this one has been copied by every receiver

    def listen(self, num_receivers: int) -> list["SharedMemoryReceiver"]:
        """Start an update (and the control channel, on the first or after a failure); returns one
        receiver per engine, to be iterated in the engine's process (``engine.update_weights(receiver, version)``)."""
        self._base += self._sent
        self._start_update(num_receivers)
        self._acked = -1
        return [SharedMemoryReceiver(self._address, rank, self._update) for rank in range(num_receivers)]

    def send(self, bucket: NamedTensors) -> None:
        metas, nbytes = layout(bucket)
        device = bucket[0][1].device if bucket else torch.device("cpu")
        index = self._sent
        self._wait_acked(index - 2)  # the slot this bucket goes into is free
        region = self._region
        if region is None or nbytes > region.slot_bytes or region.device.type != device.type:
            self._wait_acked(index - 1)
            if region is not None:
                region.unlink()
            self._generation += 1
            slot_bytes = -(-max(nbytes, self.bucket_bytes) // ALIGN_BYTES) * ALIGN_BYTES
            region = self._region = _Region(self._generation, slot_bytes, device, self.directory, self._base + index)
        offset = (index % 2) * region.slot_bytes
        pack(bucket, metas, region.tensor[offset : offset + nbytes])
        if region.device.type == "cuda":
            torch.cuda.current_stream(region.device).synchronize()  # the receiver reads on its own stream
        self._channel.post(f"{self._prefix}bucket/{index}", ("bucket", region.handle, offset, metas))
        self._sent += 1

    def finish(self) -> None:
        ranks = range(self._num_receivers)
        end_stream(self._channel, self._watch, self._sent, ranks, self._prefix)
        forget_update(self._channel, self._prefix, ranks, self._sent, first=self._acked + 1)
        self._acked = self._sent - 1
        if self._region is not None:
            self._region.unlink()  # every receiver has mapped it

    def release(self) -> None:
        """Drop the region (its /dev/shm name, if still there) and the control store."""
        if self._region is not None:
            self._region.unlink()
            self._region = None
        self._channel = self._address = None

    def _wait_acked(self, index: int) -> None:
        if index <= self._acked:
            return
        acks = [f"{self._prefix}ack/{rank}/{index}" for rank in range(self._num_receivers)]
        self._watch.until(lambda: self._channel.has(acks), f"the receivers to copy bucket {index}",
                          block=lambda seconds: self._channel.wait_for(acks, seconds))
        self._channel.forget(*acks, f"{self._prefix}bucket/{index}")
        self._acked = index
        if self._region is not None and self._base + index >= self._region.first_index:
            self._region.unlink()  # every receiver has it mapped


@dataclasses.dataclass(frozen=True)
class SharedMemoryReceiver:
    """The receiving side: iterate it in the engine's process to get the update's ``(hf_name, tensor)``.

    Tensors are views of the shared region, valid until the next one is requested (the engine copies
    each in). The iteration ends cleanly only at the sender's end of stream; it raises
    ``TransportError`` if the sender aborts or goes away, and reports its own failures to the sender.
    The connection and the region's mapping stay in this process for the sender's next update, except
    after a failure.
    """

    address: Address
    rank: int
    update: int = 1

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        def take_bucket(kept: Kept, channel: Channel, index: int, payload: tuple):
            handle, offset, metas = payload
            if handle.generation != kept.state.get("generation"):
                kept.state.clear()  # unmap the old region before mapping the new one
                kept.state.update(region=handle.open(), generation=handle.generation)
            region = kept.state["region"]
            yield from unpack(region[offset:], metas)
            if region.is_cuda:
                torch.cuda.synchronize(region.device)  # copies out of the slot are done before it is reused
            channel.post(f"{self.update}/ack/{self.rank}/{index}", None)

        return receive_kept(self.address, self.rank, self.update, take_bucket)

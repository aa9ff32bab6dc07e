"""The ``sliced`` transport's in-node path: a sender and a receiver on the same node (the plan's ``self`` and
``nvlink`` links) pass a bucket's buffer through shared memory instead of the process group: a /dev/shm file on
CPU, the buffer itself shared by CUDA IPC on GPU (``shared_memory.RegionHandle``, which also maps the GPU by its
UUID across processes with different ``CUDA_VISIBLE_DEVICES``). Two processes on one GPU (a colocated engine rank
and its training rank) cannot share an NCCL communicator, and between GPUs of one node CUDA IPC copies over NVLink.

The sender shares the buffer and posts its handle on the store (``block/{bucket}/{sender}/{receiver}``); the
receiver maps it, unlinks the file at once (nothing stays in /dev/shm, even if a process dies later), copies it into
its own buffer and posts an acknowledgement (``ack/...``), on which the sender lets the buffer go.
"""

from __future__ import annotations

import os
import secrets
from typing import Callable

import torch

from rlmega.parallel.shm import create_region
from rlmega.sync.control import Channel
from rlmega.sync.shared_memory import SHM_PREFIX, RegionHandle, device_uuid


def _key(kind: str, prefix: str, bucket: int, sender: int, receiver: int) -> str:
    return f"{prefix}{kind}/{bucket}/{sender}/{receiver}"


class StoreWait:
    """A transfer that completes through the store: ``ready()`` polled, then ``finish()`` once."""

    def __init__(self, ready: Callable[[], bool], finish: Callable[[], None]):
        self.ready, self.finish = ready, finish


class SharedBlock:
    """The sender's side of one in-node buffer."""

    def __init__(self, flat: torch.Tensor, directory: str = "/dev/shm"):
        nbytes = flat.numel() * flat.element_size()
        self.path = None
        if flat.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream(flat.device).synchronize()  # written before the receiver reads it
            self._kept = flat  # alive until the receiver has copied it
            self.handle = RegionHandle(0, nbytes, cuda_ipc=reduce_tensor(flat.view(torch.uint8)),
                                       device_uuid=device_uuid(flat.device.index))
            return
        self.path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        self._kept = create_region(self.path, nbytes)
        self._kept.copy_(flat.view(torch.uint8))
        self.handle = RegionHandle(0, nbytes, path=self.path)

    def release(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)  # the receiver unlinks it on mapping; this covers one that never did
            except FileNotFoundError:
                pass
            self.path = None
        self._kept = None


def send_in_node(channel: Channel, prefix: str, bucket: int, sender: int, receiver: int, flat: torch.Tensor,
                 outstanding: list) -> StoreWait:
    """Share ``flat`` with ``receiver``; the wait completes on its acknowledgement, and lets the buffer go.
    ``outstanding`` holds the blocks not yet acknowledged (released on a failure)."""
    block = SharedBlock(flat)
    outstanding.append(block)
    channel.post(_key("block", prefix, bucket, sender, receiver), block.handle)
    ack = _key("ack", prefix, bucket, sender, receiver)

    def finish() -> None:
        block.release()
        outstanding.remove(block)
        channel.forget(ack)

    return StoreWait(lambda: channel.has([ack]), finish)


def receive_in_node(channel: Channel, prefix: str, bucket: int, sender: int, receiver: int,
                    flat: torch.Tensor) -> StoreWait:
    """Take ``sender``'s buffer into ``flat`` once it is posted, and acknowledge it."""
    key = _key("block", prefix, bucket, sender, receiver)

    def finish() -> None:
        handle: RegionHandle = channel.get(key)
        mapped = handle.open()
        if handle.path is not None:
            try:
                os.unlink(handle.path)  # mapped: the name is no longer needed
            except FileNotFoundError:
                pass
        flat.view(torch.uint8).copy_(mapped[:handle.nbytes])
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # copied before the sender lets it go
        del mapped
        channel.forget(key)
        channel.post(_key("ack", prefix, bucket, sender, receiver), None)

    return StoreWait(lambda: channel.has([key]), finish)

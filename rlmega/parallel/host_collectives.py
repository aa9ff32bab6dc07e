"""All-reduce and broadcast through shared memory, for CPU ranks on one host.

Over gloo, a collective between two CPU processes on one machine costs 0.3 ms for four bytes and about
1 ms for a layer's activations: TCP over loopback, and a wake-up of gloo's I/O thread at every hop. A
tensor-parallel update makes a dozen of them per micro-batch, and the export's TP gather one per shard.
``HostCollectives`` does them through a region in /dev/shm that every rank of the group maps:

- ``all_reduce``: each rank copies its tensor into its own slot, publishes a sequence number, waits for
  everyone else's, and combines the slots **in rank order**, so every rank gets the same bits (for two
  ranks, the same bits gloo gives: ``a + b == b + a``);
- ``broadcast``: the source copies its tensor into its slot, the others copy it out.

Two sets of slots alternate, so a rank writes the next collective while a slow peer still reads this one;
no rank overwrites a set before every peer has finished reading it. The handshake relies on the ordering of
plain stores and loads across processes that x86-64 guarantees (no store is seen before an earlier store,
no load is done before an earlier load), so elsewhere ``HostCollectives.open`` returns None and the group keeps
gloo. ``rlmega.parallel.cpu_platform.route_collectives`` sends Megatron's groups here.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from rlmega.parallel.shm import create_region, map_region

SLOT_BYTES = 1 << 20
"""The largest tensor that goes through shared memory (a layer's activations for 2,048 tokens at hidden 128
are 1 MB); a larger one goes through gloo, where the copy, not the wake-ups, is the cost. A group of n ranks
maps 2n slots (4 MB for two ranks), and only where /dev/shm has twice that free (containers often get 64 MB)."""

_LINE = 64  # a cache line: no two ranks' flags share one, nor do two slots
_COMBINE = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}
_SPIN_S = 0.005
"""How long a wait only yields the core before its first sleep. In an update one rank often reaches a collective a
millisecond or two before the other (their work is not split evenly), and a sleeping waiter oversleeps by up to its
last pause; yielding lets any other runnable thread have the core meanwhile."""
_FLAG_ARRAYS = 3  # arrived, done, pid
_PID_CHECK_S = 0.2  # how often a waiting rank looks whether a late peer's process still exists


def supported(nbytes: int = 0) -> bool:
    """x86-64 Linux (see the module's note on ordering) with twice ``nbytes`` free in /dev/shm: a write to a
    page of a region that /dev/shm cannot hold kills the process (SIGBUS), so there is room to spare."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir("/dev/shm"):
        return False
    stats = os.statvfs("/dev/shm")
    return stats.f_bavail * stats.f_frsize >= 2 * nbytes


class Completed:
    """What a collective asked for with ``async_op=True`` returns here: it is already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class HostCollectives:
    """All-reduce (sum, max, min) and broadcast over ``group``, whose ranks share this host's /dev/shm."""

    def __init__(self, group, region: torch.Tensor, timeout_s: float, slot_bytes: int, path: str):
        self.group = group
        self.path = path  # unlinked once every rank has mapped it
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self._region = region
        # The last collective each rank has entered, the last one it has finished reading, and its process: numpy
        # views, because every torch call here also passes through the CPU platform's torch-function mode, and the
        # flags are read in a loop (as torch tensors a two-rank all-reduce of one number took 130 us, not 15).
        self._arrived, self._done, pids = _flags(region.numpy(), self.size)
        self._pids = pids.tolist()
        # Whether a peer that is late can be told from one that is gone (its process visible from here).
        self._watch_pids = all(_alive(pid) for pid in self._pids)
        slots = region[_FLAG_ARRAYS * self.size * _LINE:]
        self._slots = [[slots[(parity * self.size + rank) * slot_bytes:][:slot_bytes] for rank in range(self.size)]
                       for parity in range(2)]
        self._views: dict = {}  # (parity, dtype, shape) -> every rank's slot as a tensor of that kind
        self._sequence = 0

    @classmethod
    def open(cls, group, timeout_s: float = 300.0, slot_bytes: int = SLOT_BYTES) -> Optional[HostCollectives]:
        """Collective over ``group`` (its gloo collectives, once): the shared region, or None when some rank
        cannot map it (another host, or another /dev/shm) or the machine is not x86-64; every rank agrees."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        slot_bytes = -(-slot_bytes // _LINE) * _LINE
        total = _FLAG_ARRAYS * size * _LINE + 2 * size * slot_bytes
        name = [f"/dev/shm/rlmega-collectives-{uuid.uuid4().hex}" if rank == 0 and supported(total) else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
        path = name[0]
        region = None
        try:
            if path is not None and rank == 0:
                region = _region(create_region, path, total)
            dist.barrier(group=group)
            if path is not None and rank != 0 and supported(total):
                region = _region(map_region, path, total)
            if region is not None:
                _flags(region.numpy(), size)[2][rank] = os.getpid()
            mapped = torch.tensor([int(region is not None)])
            dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped it, pid in
        finally:
            if path is not None and rank == 0 and os.path.exists(path):
                os.unlink(path)  # nothing is left in /dev/shm, whatever happens next
        return cls(group, region, timeout_s, slot_bytes, path) if int(mapped) else None

    def takes(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> bool:
        """Whether this collective goes through shared memory (else through gloo)."""
        return (op in _COMBINE and tensor.device.type == "cpu" and 0 < tensor.numel()
                and tensor.numel() * tensor.element_size() <= self.slot_bytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce ``tensor`` in place over the group; every rank gets the same values."""
        parity, sequence = self._enter()
        slots = self._slots_like(parity, tensor)
        slots[self.rank].copy_(tensor)
        self._arrived[self.rank] = sequence
        self._wait(self._arrived, sequence, range(self.size))
        combine = _COMBINE[op]
        if self.size == 2:
            combine(slots[0], slots[1], out=tensor)
        else:
            result = combine(slots[0], slots[1])
            for slot in slots[2:]:
                combine(result, slot, out=result)
            tensor.copy_(result)
        self._done[self.rank] = sequence

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` of group rank ``src`` into ``tensor`` on every rank."""
        parity, sequence = self._enter()
        slot = self._slots_like(parity, tensor)[src]
        if self.rank == src:
            slot.copy_(tensor)
        self._arrived[self.rank] = sequence
        if self.rank != src:
            self._wait(self._arrived, sequence, (src,))
            tensor.copy_(slot)
        self._done[self.rank] = sequence

    def _enter(self) -> tuple[int, int]:
        """The next collective's number and slot set, once every peer has finished reading what that set held."""
        self._sequence += 1
        self._wait(self._done, self._sequence - 2, range(self.size))
        return self._sequence % 2, self._sequence

    def _slots_like(self, parity: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of set ``parity`` as a tensor of ``like``'s dtype and shape (made once per kind: an
        update repeats a handful of shapes)."""
        key = (parity, like.dtype, like.shape)
        views = self._views.get(key)
        if views is None:
            nbytes = like.numel() * like.element_size()
            views = self._views[key] = [slot[:nbytes].view(like.dtype).view(like.shape) for slot in self._slots[parity]]
        return views

    def _wait(self, flags: np.ndarray, sequence: int, ranks) -> None:
        """Until the flags of ``ranks`` reach ``sequence``: yielding the core at first, then sleeping a little
        longer each time, so a punctual peer costs microseconds and a late one keeps no core busy."""
        def late() -> list[int]:
            return [rank for rank in ranks if flags[rank] < sequence]

        if sequence <= 0 or not late():
            return
        start = time.monotonic()
        checked, spin_until = start, start + _SPIN_S
        pause = 0.0
        while late():
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if self._watch_pids and now - checked > _PID_CHECK_S:
                checked = now
                gone = [rank for rank in late() if not _alive(self._pids[rank])]
                if gone:
                    raise RuntimeError(f"collective {sequence} over a group of {self.size} ranks: group rank(s) "
                                       f"{gone} exited (pid {', '.join(str(self._pids[rank]) for rank in gone)})")
            if now - start > self.timeout_s:
                raise TimeoutError(
                    f"collective {sequence} over a group of {self.size} ranks: group rank(s) {late()} did not arrive "
                    f"within {self.timeout_s:.0f} s (stuck in other work)")
            pause = min(1e-3, pause * 2 or 2e-5)
            time.sleep(pause)


def _region(make, path: str, nbytes: int) -> Optional[torch.Tensor]:
    """``make(path, nbytes)``, or None where this process cannot (another /dev/shm, no room): gloo it is."""
    try:
        return make(path, nbytes)
    except OSError:
        return None


def _flags(region: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The region's arrived, done and pid arrays: one int64 per rank each, every entry on a line of its own."""
    flags = region[: _FLAG_ARRAYS * size * _LINE].view(np.int64)
    stride = _LINE // 8
    return tuple(flags[index * size * stride: (index + 1) * size * stride: stride] for index in range(_FLAG_ARRAYS))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return pid > 0 and stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # not readable from here: say alive, and let the timeout decide

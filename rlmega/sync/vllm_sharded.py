"""vLLM 0.33's ``sharded_rdt`` weight transfer, driven from the Megatron trainer: each engine worker pulls only the
slices its own loaders read, so an engine rank receives its share of the model instead of all of it.

How a sync runs (read in the 0.33.0 wheel: vllm/distributed/weight_transfer/base.py, factory.py,
sharded_rdt_trainer.py, sharded_rdt_engine.py, vllm/entrypoints/rl/offline.py):

- once, on every trainer rank: ``WeightTransferTrainerFactory.trainer_init(ShardedRDTTrainerInitInfo(...,
  rank=r), client=..., source=megatron_weight_source(chunks, spec))``. Each rank starts a producer actor on its
  node and GPU for the tensors it owns; rank 0 (the sender) then hands the engines their plan (every name,
  shape, gather group and owner set) through the client;
- each sync, on every trainer rank: ``send_weights()``. Each rank gathers its owned tensors group by group
  (``WeightSource.iter_full``: Megatron's TP gathers, within one TP group) and publishes them; rank 0 drives
  the engines' start / update / finish, and the engines' workers pull their slices over NIXL.

``ShardedSync`` is that, with rlmega's engines on the other end: ``VLLMEngine``s built with
``weight_transfer="sharded_rdt"``, in this process or in Ray actors. ``EnginesClient`` is vLLM's
``VLLMWeightSyncClient`` over them: each call goes to every engine at once, since a gather group is freed
only when every worker of every engine has pulled it, and each engine gets its ``replica_rank``. It needs what
the backend needs: GPUs, the trainer ranks inside Ray (its producer actors), and Ray's NIXL tensor transport.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, wait
from typing import Optional, Sequence

import torch.distributed as dist

from rlmega.bridge.pieces import piece_layout
from rlmega.models.spec import ModelSpec
from rlmega.rollout.vllm_weight_source import megatron_weight_source
from rlmega.sync import sharded_rdt_needs
from rlmega.sync.errors import TransportError
from rlmega.sync.config import SHARDED_RDT
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, in_thread
from rlmega.sync.stats import SyncStats


def _call(engine, method: str, *args) -> Future:
    """``engine.method(*args)`` in the background: a Ray call for an engine actor (``RemoteEngine``), a daemon
    thread for an engine object here."""
    actor = getattr(engine, "actor", None)
    if actor is not None:
        return getattr(actor, method).remote(*args).future()
    return in_thread(getattr(engine, method), *args)


class EnginesClient:
    """vLLM's ``VLLMWeightSyncClient`` (four methods, structural) over rlmega ``VLLMEngine``s built with
    ``weight_transfer="sharded_rdt"``. Set ``version`` before each sync: it is the version the engines commit."""

    def __init__(self, engines: Sequence, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not engines:
            raise ValueError("EnginesClient needs at least one engine")
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.version: Optional[int] = None

    def _all(self, method: str, args_of=lambda index: ()) -> list:
        futures = [_call(engine, method, *args_of(index)) for index, engine in enumerate(self.engines)]
        done, late = wait(futures, timeout=self.timeout_s)
        for index, future in enumerate(futures):
            if future in late:
                raise TransportError(f"sharded_rdt: rollout engine {index} did not finish {method} within "
                                     f"{self.timeout_s:.0f} s")
            if future.exception() is not None:
                raise TransportError(f"sharded_rdt: rollout engine {index} failed in {method}: "
                                     f"{future.exception()}") from future.exception()
        return [future.result() for future in futures]

    def workers(self) -> int:
        """Workers per engine (tensor x pipeline x data parallel); vLLM's plan needs them equal in every engine."""
        counts = self._all("native_transfer_workers")
        if len(set(counts)) != 1:
            raise ValueError(f"sharded_rdt needs every engine to have the same number of workers, got {counts}: "
                             "give the engines one parallel layout")
        return counts[0]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        count = len(self.engines)
        self._all("native_transfer_init", lambda index: ({**init_info, "replica_rank": index, "num_replicas": count},))

    def start_weight_update(self) -> None:
        if self.version is None:
            raise RuntimeError("EnginesClient.version is not set: ShardedSync.push sets it before each sync")
        self._all("native_transfer_start", lambda index: (self.version,))

    def update_weights(self, update_info) -> None:
        self._all("native_transfer_update", lambda index: (update_info,))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._all("native_transfer_finish")


class _NotTheSender:
    """The client of trainer ranks other than 0: vLLM's trainer engine calls the client on the sender only."""

    def __getattr__(self, name):
        raise RuntimeError(f"sharded_rdt called {name} on trainer rank {dist.get_rank()}; only rank 0 drives the "
                           "engines")


class ShardedSync:
    """vLLM's ``sharded_rdt`` transfer from this trainer's Megatron ``chunks`` into ``engines``.

    Collective: construct it and call ``push`` on every trainer rank, in the same order, with ``engines`` on
    rank 0 (the sender) and None on the others. ``settings`` go to ``ShardedRDTTrainerInitInfo``
    (``num_rdt_buffers``, ``buffer_presize_gb``, ``gather_lookahead``, ``trainer_actor_namespace``);
    ``timeout_s`` bounds every engine call and is the producers' stall timeout. A ``Transport`` of
    ``rlmega.sync.weight_sync``."""

    name = SHARDED_RDT

    def __init__(self, chunks: list, spec: ModelSpec, engines: Optional[Sequence], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **settings):
        sharded_rdt_needs.require()  # vLLM itself checks Ray only at the first pull, and nixl not at all
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.sharded_rdt_trainer import ShardedRDTTrainerInitInfo

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if (self.rank == 0) != (engines is not None):
            raise ValueError(f"ShardedSync takes the engines on trainer rank 0 (the sender) and None elsewhere; "
                             f"rank {self.rank} got {'engines' if engines is not None else 'None'}")
        self.engines = list(engines) if engines is not None else []
        self.client = EnginesClient(self.engines, timeout_s=timeout_s) if self.engines else _NotTheSender()
        fleet = [self.client.workers(), len(self.engines)] if self.rank == 0 else [None, None]
        if dist.is_initialized():
            dist.broadcast_object_list(fleet, src=0)  # the init info must agree on every rank
        workers, count = fleet
        owned = [piece for piece in piece_layout(chunks, spec) if self.rank in piece.owners]
        self.tensors = len(owned)
        self.bytes = sum(piece.dtype.itemsize * math.prod(piece.shape) for piece in owned)
        """Bytes this rank serves per sync: its owned tensors, whole (the engines' workers pull slices of them)."""
        info = ShardedRDTTrainerInitInfo(workers * count, workers_per_replica=workers if count > 1 else 0,
                                         stall_timeout_s=float(timeout_s), rank=self.rank, **settings)
        self.sender = WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=megatron_weight_source(chunks, spec))

    def push(self, version: int) -> SyncStats:
        """Serve this model to the engines as ``version``; on rank 0, returns once every engine committed it."""
        started = time.perf_counter()
        if self.engines:
            self.client.version = version
        self.sender.send_weights()
        return SyncStats(version=version, tensors=self.tensors, bytes=self.bytes,
                         seconds=time.perf_counter() - started, transport=SHARDED_RDT if self.engines else None)

    def close(self) -> None:
        """Stop this rank's producer (vLLM's ``shutdown``)."""
        self.sender.shutdown()

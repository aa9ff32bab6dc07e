"""A sliced refit run for real, on one machine: training ranks of a tiny model in one parallel layout feed engine-rank
processes of another through the ``sliced`` transport, and each side's bytes per link are set against the plan's.

On CPU (gloo) it proves the transport follows the plan: every engine rank ends with exactly its region of each
tensor, bit for bit the checkpoint's, and the bytes each rank sent and received per link kind are the plan's. On a
GPU node (NCCL; the engine ranks on GPUs of their own, after the training ranks') it also times a real refit
against the planner's prediction. ``benchmarks/refit_plan.py --emulate`` and ``tests/sync/test_sliced.py`` run it.

Each update after the first doubles every weight (the same on every replica), so the engines must take new values
over the group kept from the update before; ``fail_rank`` makes that training rank fail in the last update's
conversion of update ``fail_update``, which must fail it on every side with nothing committed; the updates after it
must go through on a new group.
"""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rlmega.parallel.layout import ParallelLayout
from rlmega.rollout.engine_bytes import EngineLayout
from rlmega.sync.transfer_plan import LINKS, Placement, TransferPlan, plan_transfer


@dataclasses.dataclass(frozen=True)
class Emulation:
    """What to run: a checkpoint, the training layout, the engines and where they sit."""

    hf_dir: str
    training: ParallelLayout
    engine: EngineLayout
    num_engines: int
    gpus_per_node: int
    colocated: bool
    bucket_bytes: int = 96 * 1024
    updates: int = 2
    fail_rank: Optional[int] = None
    fail_update: int = -1
    """Which update (from 0; -1: the last) ``fail_rank`` fails."""
    timeout_s: float = 240.0

    @property
    def hf_config(self) -> dict:
        return json.loads((Path(self.hf_dir) / "config.json").read_text())

    def plan(self, placed: list) -> TransferPlan:
        placement = Placement.of(num_engines=self.num_engines, engine_size=self.engine.world_size,
                                 gpus_per_node=self.gpus_per_node, colocated=self.colocated,
                                 training_world=self.training.world_size)
        return plan_transfer(placed, self.hf_config, self.engine, placement)


@dataclasses.dataclass
class EngineRankResult:
    engine: int
    rank: int
    saved_regions: Optional[bytes]
    """{hf name: its block}, ``torch.save``d; None if the update failed"""
    received: dict
    """bytes per link kind"""
    error: Optional[str]

    @property
    def regions(self) -> Optional[dict]:
        return None if self.saved_regions is None else torch.load(io.BytesIO(self.saved_regions))


def _engine_rank(inbox, outbox, device: Optional[int]) -> None:
    """An engine rank's process: iterate each update's receiver, report what it received."""
    if device is not None:
        torch.cuda.set_device(device)
    while True:
        receiver = inbox.get()
        if receiver is None:
            return
        try:
            regions = {name: tensor.cpu().clone() for name, tensor in receiver}
            buffer = io.BytesIO()
            torch.save(regions, buffer)  # by value through the queue
            outbox.put(EngineRankResult(receiver.engine, receiver.rank, buffer.getvalue(), dict(receiver.received), None))
        except Exception as error:  # noqa: BLE001 - reported to the driver
            outbox.put(EngineRankResult(receiver.engine, receiver.rank, None, dict(receiver.received),
                                        f"{type(error).__name__}: {error}"))


def _doubled(chunks: list) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.mul_(2)


def _failing_after(count: int, real):
    def held(chunks, spec):
        for index, item in enumerate(real(chunks, spec)):
            if index == count:
                raise RuntimeError("conversion failed on purpose")
            yield item
    return held


def training_rank(rank: int, world_size: int, emulation: Emulation) -> dict:
    """One training rank (``rlmega.parallel.spawn.run_on_ranks``); rank 0 also starts the engine-rank processes."""
    from rlmega.bridge import load_hf_weights
    from rlmega.bridge.held_pieces import placed_layout
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import destroy, initialize
    from rlmega.sync import sliced
    from rlmega.sync.errors import TransportError

    initialize(emulation.training)
    spec = model_spec_from_hf(emulation.hf_dir)
    chunks = build_chunks(spec, emulation.training)
    load_hf_weights(chunks, spec, emulation.hf_dir)
    placed = placed_layout(chunks, spec, emulation.training)
    plan = emulation.plan(placed)
    dtype = torch.float32 if plan.layout.dtype_bytes == 4 else torch.bfloat16
    transport = sliced.SlicedTransport(chunks, spec, plan, dtype=dtype, bucket_bytes=emulation.bucket_bytes,
                                       timeout_s=emulation.timeout_s / 2)
    processes, inboxes, outbox = [], [], None
    if rank == 0:
        context = multiprocessing.get_context("spawn")
        outbox = context.Queue()
        gpus = [gpu for engine in plan.placement.engine_gpus for gpu in engine]
        for gpu in gpus:
            inboxes.append(context.Queue())
            device = gpu if transport.backend == "nccl" else None
            processes.append(context.Process(target=_engine_rank, args=(inboxes[-1], outbox, device), daemon=True))
            processes[-1].start()
    result = {"placed": placed, "sent": [], "seconds": [], "engines": [], "errors": []}
    held_pieces = transport.held_pieces
    for update in range(emulation.updates):
        if update:
            _doubled(chunks)
        failing = emulation.fail_rank == rank and update == range(emulation.updates)[emulation.fail_update]
        transport.held_pieces = _failing_after(3, held_pieces) if failing else held_pieces
        if rank == 0:
            for inbox, receiver in zip(inboxes, [r for engine in transport.listen() for r in engine]):
                inbox.put(receiver)
        before = dict(transport.sent)
        torch.distributed.barrier()
        started = time.perf_counter()
        try:
            transport.push(update + 1)
        except TransportError as error:
            result["errors"].append((update, str(error)))
        torch.distributed.barrier()
        result["seconds"].append(time.perf_counter() - started)
        result["sent"].append({link: transport.sent[link] - before[link] for link in LINKS})
        if rank == 0:
            result["engines"].append([outbox.get(timeout=emulation.timeout_s) for _ in inboxes])
    for inbox in inboxes:
        inbox.put(None)
    for process in processes:
        process.join(timeout=emulation.timeout_s)
    transport.close()
    destroy()
    return result


@dataclasses.dataclass
class EmulationReport:
    plan: TransferPlan
    placed: list
    sent: list
    """per update, per training rank: bytes per link kind"""
    engines: list
    """per update, the ``EngineRankResult`` of every engine rank"""
    errors: list
    """per training rank, ``(update, error)`` of each update that failed there"""
    seconds: list
    """per update, the slowest rank's wall time of the push"""

    def measured(self, update: int) -> tuple[np.ndarray, np.ndarray]:
        """(sent, received): [GPUs, len(LINKS)] bytes, as ``plan.traffic`` counts them."""
        traffic = self.plan.traffic
        sent, received = np.zeros_like(traffic.sent_bytes), np.zeros_like(traffic.received_bytes)
        for rank, per_rank in enumerate(self.sent[update]):
            sent[rank] = [per_rank[link] for link in LINKS]
        for result in self.engines[update]:
            gpu = self.plan.placement.engine_gpus[result.engine][result.rank]
            received[gpu] = [result.received[link] for link in LINKS]
        return sent, received

    def mismatches(self, update: int, checkpoint: dict) -> list[str]:
        """``engine/rank/name`` of every region that is not the checkpoint's (times 2 per update) bit for bit, or
        that a rank holds but did not get, or got but does not hold."""
        from rlmega.rollout.engine_bytes import held_region

        wrong = []
        for result in self.engines[update]:
            regions = result.regions or {}
            for tensor in self.plan.tensors:
                region = held_region(tensor, self.plan.layout, result.rank)
                where = f"{result.engine}/{result.rank}/{tensor.name}"
                if region is None:
                    wrong += [where] if tensor.name in regions else []
                    continue
                want = checkpoint[tensor.name][tuple(slice(a, b) for a, b in region)] * 2 ** update
                got = regions.get(tensor.name)
                if got is None or not torch.equal(got, want.to(got.dtype)):
                    wrong.append(where)
        return wrong


def emulate(emulation: Emulation) -> EmulationReport:
    """Run ``emulation``: its training ranks and, started by rank 0, its engine-rank processes."""
    from rlmega.parallel.spawn import run_on_ranks

    results = run_on_ranks(training_rank, emulation.training.world_size, timeout_s=emulation.timeout_s,
                           args=(emulation,))
    updates = range(emulation.updates)
    return EmulationReport(emulation.plan(results[0]["placed"]), results[0]["placed"],
                           [[result["sent"][u] for result in results] for u in updates], results[0]["engines"],
                           [result["errors"] for result in results],
                           [max(result["seconds"][u] for result in results) for u in updates])

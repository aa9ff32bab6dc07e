"""The sliced refit's time, from the transfer plan (``rlmega.sync.transfer_plan``): every training rank sends what
it owns, in parallel, to only the engine ranks that hold it.

Per GPU: the slowest of its four directions (out and in, over NVLink and over the network; a GPU's links and
directions run at once), plus its messages (the more of sent and received) times ``plan.message_latency_us``.
NVLink runs at the GPU preset's (or ``plan.nvlink_gb_per_s``), the network at ``plan.ib_gb_per_s /
plan.gpus_per_node`` (one NIC per GPU); a block already on the receiver's GPU costs its message's latency only
(a copy inside the GPU's memory). The refit takes as long as the slowest GPU. No contention beyond one GPU's own
links (switches are taken as non-blocking), no conversion on either side.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from rlmega.bridge.layout_pieces import placed_pieces
from rlmega.rollout.engine_bytes import EngineLayout
from rlmega.sync.transfer_plan import LINKS, NETWORK, NVLINK, SELF, Placement, Traffic, plan_transfer

BUSIEST = 4
"""GPUs listed by ``--explain``."""


@dataclasses.dataclass
class GpuTime:
    gpu: int
    seconds: float
    bound: str
    """What bounds it: "network out", "nvlink in", ... (or "latency" when no bytes cross a link)."""
    sent: dict[str, float]
    received: dict[str, float]
    messages: int
    """The more of sent and received."""


@dataclasses.dataclass
class SlicedRefit:
    label: str
    replicas: bool
    """Whether every replica sends (False: data-parallel replica 0 alone, as ``sharded_rdt`` serves)."""
    gb_per_s: dict[str, float]
    """Per link kind, one GPU's bandwidth in one direction (self: none, a copy in its memory)."""
    message_latency_s: float
    link_messages: dict[str, int]
    link_bytes: dict[str, int]
    link_seconds: dict[str, float]
    """Per link kind, the busiest GPU's bytes on it (one direction) over its bandwidth."""
    busiest: list[GpuTime]
    """The slowest GPUs, slowest first."""
    tensors: int
    not_loaded: int
    """Training tensors no engine loads (MTP layers)."""
    plan_seconds: float
    """How long the planner took to make the transfer plan and sum it."""

    @property
    def seconds(self) -> float:
        return self.busiest[0].seconds if self.busiest else 0.0

    @property
    def slowest(self) -> Optional[GpuTime]:
        return self.busiest[0] if self.busiest else None


def gpu_times(traffic: Traffic, gb_per_s: dict[str, float], latency_s: float) -> list[GpuTime]:
    """Every GPU's time, slowest first."""
    per_second = np.array([0.0 if link == SELF else 1.0 / (gb_per_s[link] * 1e9) for link in LINKS])
    out, into = traffic.sent_bytes * per_second, traffic.received_bytes * per_second
    directions = np.concatenate([out, into], axis=1)  # [GPU, out links + in links]
    messages = np.maximum(traffic.sent_messages, traffic.received_messages)
    seconds = directions.max(axis=1) + messages * latency_s
    names = [f"{link} {way}" for way in ("out", "in") for link in LINKS]
    times = []
    for gpu in np.argsort(-seconds, kind="stable"):
        bound = names[int(directions[gpu].argmax())] if directions[gpu].max() > 0 else "latency"
        times.append(GpuTime(int(gpu), float(seconds[gpu]), bound,
                             {link: float(traffic.sent_bytes[gpu, i]) for i, link in enumerate(LINKS)},
                             {link: float(traffic.received_bytes[gpu, i]) for i, link in enumerate(LINKS)},
                             int(messages[gpu])))
    return times


def predict_sliced(config, spec, layout, hf_config: dict, nvlink_gb_per_s: float, *, replicas: bool,
                   label: str) -> SlicedRefit:
    """The sliced transfer of the run ``config`` describes, and its time."""
    started = time.perf_counter()
    rollout, plan = config.rollout, config.plan
    tp, dp = rollout.tensor_parallel_size, rollout.data_parallel_size
    # vLLM's expert parallelism spans the engine's TP x DP ranks (as the planner lays out the engines' weights).
    engine = EngineLayout(tensor_parallel_size=tp, data_parallel_size=dp,
                          expert_parallel_size=tp * dp if rollout.expert_parallel_size > 1 else 1)
    placement = Placement.of(num_engines=rollout.num_engines, engine_size=rollout.gpus_of_one_engine,
                             gpus_per_node=plan.gpus_per_node, colocated=rollout.placement == "colocated",
                             training_world=layout.world_size)
    # The plan is for GPUs: transformer-engine's layers, whatever this machine has.
    transfer = plan_transfer(placed_pieces(spec, layout, transformer_engine=True), hf_config, engine, placement,
                             replicas=replicas)
    traffic = transfer.traffic
    gb_per_s = {SELF: 0.0, NVLINK: nvlink_gb_per_s, NETWORK: plan.ib_gb_per_s / plan.gpus_per_node}
    latency = plan.message_latency_us * 1e-6
    busiest_bytes = np.maximum(traffic.sent_bytes.max(axis=0), traffic.received_bytes.max(axis=0))
    link_seconds = {link: 0.0 if link == SELF else float(busiest_bytes[i]) / (gb_per_s[link] * 1e9)
                    for i, link in enumerate(LINKS)}
    return SlicedRefit(label=label, replicas=replicas, gb_per_s=gb_per_s, message_latency_s=latency,
                       link_messages=traffic.link_messages, link_bytes=traffic.link_bytes, link_seconds=link_seconds,
                       busiest=gpu_times(traffic, gb_per_s, latency)[:BUSIEST], tensors=len(transfer.pieces),
                       not_loaded=len(transfer.not_loaded), plan_seconds=time.perf_counter() - started)

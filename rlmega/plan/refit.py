"""The weight sync (refit) of a plan: bytes each trainer rank sends and each engine GPU receives per
sync, over which links, and the time the link bandwidths allow.

The data path is the trainer's (``rlmega.sync.push_weights`` with ``engine_rank=0``): the bridge's export
gathers each parameter on its owner (data-parallel replica 0, TP rank 0 of its group: the dense
parameters once per stage, the experts once per expert-parallel rank) and sends its HF tensors to
trainer rank 0, which holds the engine handles and streams every bucket to every engine through the
sync transport; each engine's workers all load every tensor (vLLM's ``collective_rpc``). Bytes are the
measured ones (``meta_build``: the bridge's own names and ownership, bf16, vocabulary padding trimmed).

Times are bandwidth-only lower bounds: a leg takes its bytes over its slowest link; the export double-
buffers, so the legs overlap (the total is the slowest leg) and cannot take longer than their sum.

``sync.lora=adapters`` (a LoRA actor) streams the adapters alone (``adapter_refit``): every leg carries the adapters'
share of the model's bytes, and there is no sliced target (the sliced transfers move base weights).

``sync.transport=sharded_rdt`` (vLLM's sliced transfer, each engine rank pulling its blocks from the owners) has no
such legs: its time is the transfer plan's (``sliced_refit``), with data-parallel replica 0 sending. Every plan also
carries the target, the same plan with every replica sending.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlmega.errors import UserError
from rlmega.plan.adapter_refit import adapter_bytes
from rlmega.plan.meta_build import StageCoordinates
from rlmega.plan.sliced_refit import SlicedRefit, predict_sliced
from rlmega.rollout.engine_bytes import fp8_stream_fraction

GB = 1e9


@dataclasses.dataclass
class Leg:
    name: str
    bytes: float
    link: str
    gb_per_s: float

    @property
    def seconds(self) -> float:
        return self.bytes / (self.gb_per_s * GB) if self.bytes else 0.0


@dataclasses.dataclass
class Refit:
    transport: str
    """The transport the trainer uses (``sync.transport``, with ``auto`` resolved as the trainer does)."""
    requested: str
    bytes_per_sync: float
    """HF bytes streamed from trainer rank 0 to each engine per sync (MTP layers included, if built)."""
    totals: dict
    senders: list[dict]
    """Per trainer rank class: {"ranks", "count", "bytes", "link"} (the link to rank 0)."""
    engine_gpu_receives: float
    legs: list[Leg]
    sliced: Optional[SlicedRefit] = None
    """``sharded_rdt``'s own transfer plan and time (None for the other transports)."""
    target: Optional[SlicedRefit] = None
    """The sliced transfer with every replica sending (None where the engines or the model have no plan)."""
    no_target: str = ""
    """Why there is no target, where there is none though there are engines."""
    adapters_only: bool = False
    """``sync.lora=adapters``: the bytes are the LoRA adapters', not the model's."""

    @property
    def seconds_overlapped(self) -> float:
        if self.sliced is not None:
            return self.sliced.seconds
        inbound = sum(leg.seconds for leg in self.legs if leg.name.startswith("owners"))  # one receiver: in turn
        return max([inbound] + [leg.seconds for leg in self.legs if not leg.name.startswith("owners")])

    @property
    def seconds_serial(self) -> float:
        if self.sliced is not None:
            return self.sliced.seconds
        return sum(leg.seconds for leg in self.legs)


def _totals(layout, positions: list[dict]) -> dict:
    totals = dict(dense_split=0, dense_replicated=0, expert=0, mtp=0, largest=0)
    for position in positions:
        counts = position["roles"]["actor"]["sync_bytes"]
        stages = len(position["stages"])
        totals["dense_split"] += stages * counts["dense_split"]
        totals["dense_replicated"] += stages * counts["dense_replicated"]
        totals["expert"] += stages * layout.ep * counts["expert"]
        totals["mtp"] += stages * (counts["mtp_dense"] + layout.ep * counts["mtp_expert"])
        totals["largest"] = max(totals["largest"], counts["largest"])
    engine_bytes = totals["dense_split"] + totals["dense_replicated"] + totals["expert"]
    totals.update(engine_bytes=engine_bytes, engine_params=engine_bytes / 2, mtp_params=totals["mtp"] / 2,
                  bytes=engine_bytes + totals["mtp"])
    return totals


def _senders(layout, positions: list[dict], gpus_per_node: int) -> list[dict]:
    """Owner classes of each position: rank 0 of the stage (dense and its experts), the other expert
    owners, and where each sits relative to trainer rank 0."""
    per_stage = layout.world_size // layout.pp
    coordinates = [StageCoordinates.of(i, layout) for i in range(per_stage)]
    dense_owner = [c.tp_rank == 0 and c.data_parallel_index == 0 for c in coordinates]
    expert_owners = [i for i, c in enumerate(coordinates) if c.expert_tp_rank == 0 and c.expert_data_parallel_rank == 0]
    rows = []
    for position in positions:
        counts = position["roles"]["actor"]["sync_bytes"]
        dense = counts["dense_split"] + counts["dense_replicated"] + counts["mtp_dense"]
        expert = counts["expert"] + counts["mtp_expert"]
        by_link: dict = {}
        for stage in position["stages"]:
            owners = sorted({*(i for i, owns in enumerate(dense_owner) if owns), *(expert_owners if expert else ())})
            for index in owners:
                rank = stage * per_stage + index
                sent = (dense if dense_owner[index] else 0) + (expert if index in expert_owners else 0)
                link = "self" if rank == 0 else "nvlink" if rank // gpus_per_node == 0 else "ib"
                kind = "dense + experts" if dense_owner[index] and expert else "dense" if dense_owner[index] else "experts"
                entry = by_link.setdefault((kind, link), dict(stages=position["stages"], kind=kind, link=link,
                                                                 count=0, bytes_each=sent, first_rank=rank))
                entry["count"] += 1
        rows.extend(by_link.values())
    return rows


def _engine_gpus(config, layout) -> list[list[int]]:
    """Global GPU indices of each engine: colocated, packed onto the trainer's GPUs; disaggregated, after them."""
    rollout = config.rollout
    size = rollout.gpus_of_one_engine
    start = 0 if rollout.placement == "colocated" else layout.world_size
    return [list(range(start + e * size, start + (e + 1) * size)) for e in range(rollout.num_engines)]


def plan_refit(config, layout, positions: list[dict], preset, spec, hf_config: dict) -> Refit:
    """The refit of ``config``'s transport, and the sliced target (``spec``, ``hf_config``: the model's)."""
    # An FP8 sync streams the linear weights quantized: about half the bytes, the same tensors.
    fraction = fp8_stream_fraction(hf_config) if config.rollout.weight_dtype == "fp8" else 1.0
    adapters = config.sync.lora == "adapters" and config.actor.lora.enabled
    refit = _funnel(config, layout, positions, preset, fraction, adapter_bytes(config, spec) if adapters else None)
    if not config.rollout.num_engines:
        return refit
    if adapters:
        refit.no_target = "sync.lora=adapters streams the adapters alone; the sliced transfers move base weights"
        return refit
    try:
        if refit.transport == "sharded_rdt":
            refit.sliced = predict_sliced(config, spec, layout, hf_config, preset.nvlink_gb_per_s, replicas=False,
                                          label="sharded_rdt: data-parallel replica 0 sends")
        refit.target = predict_sliced(config, spec, layout, hf_config, preset.nvlink_gb_per_s, replicas=True,
                                      label="every replica sends")
    except ValueError as error:  # a model with no analytic layout (vision-language, reward model): no sliced plan
        if refit.transport == "sharded_rdt":
            raise UserError(f"sync.transport=sharded_rdt: {error}") from None
        refit.no_target = str(error)
    return refit


def _funnel(config, layout, positions: list[dict], preset, stream_fraction: float = 1.0,
            adapters: Optional[int] = None) -> Refit:
    """Through trainer rank 0: the owners' bytes to it, and from it to every engine (``stream_fraction`` of the
    HF bytes the owners send: rank 0 quantizes an FP8 sync before it streams). ``adapters``: the bytes of the LoRA
    adapters a ``sync.lora=adapters`` sync sends instead, which the owners hold in the model's proportions."""
    totals = _totals(layout, positions)
    gpn, nvlink = config.plan.gpus_per_node, preset.nvlink_gb_per_s
    ib_per_gpu = config.plan.ib_gb_per_s / gpn
    senders = _senders(layout, positions, gpn)
    share = 1.0
    if adapters is not None:  # each owner sends its layers' adapters: its share of the model's bytes
        share, stream_fraction = adapters / totals["bytes"], 1.0
        for row in senders:
            row["bytes_each"] *= share
    inbound = {"nvlink": 0.0, "ib": 0.0}
    for row in senders:
        if row["link"] != "self":
            inbound[row["link"]] += row["count"] * row["bytes_each"]
    engines = _engine_gpus(config, layout)
    streamed = totals["bytes"] * stream_fraction * share
    transport = config.sync.transport
    if transport == "auto":  # as rlmega.sync.make_transport picks for engine actors
        transport = "shared_memory" if all(gpus[0] // gpn == 0 for gpus in engines) else "object_store"
    # Each owner first gathers its parameters' other TP (expert: ETP) shards inside its group, on its node.
    gather = share * max(counts["dense_split"] * (layout.tp - 1) / layout.tp
                         + counts["expert"] * (layout.expert_tp - 1) / layout.expert_tp
                         for counts in (p["roles"]["actor"]["sync_bytes"] for p in positions))
    legs = [Leg("TP shards -> their owner (the fullest)", gather, "NVLink", nvlink),
            Leg("owners -> rank 0 (same node)", inbound["nvlink"], "NVLink", nvlink),
            Leg("owners -> rank 0 (other nodes)", inbound["ib"], "InfiniBand, rank 0's NIC", ib_per_gpu)]
    if transport == "sharded_rdt":  # no funnel through rank 0: the transfer plan's time (sliced_refit)
        legs = []
    elif transport == "broadcast":
        far = any(g // gpn != 0 for gpus in engines for g in gpus)
        legs.append(Leg("rank 0 -> every engine GPU (one NCCL broadcast)", streamed,
                        "InfiniBand" if far else "NVLink", ib_per_gpu if far else nvlink))
    else:
        if transport == "object_store":
            legs.append(Leg(f"rank 0 -> {len(engines)} engine(s)", streamed * len(engines), "Ray object store",
                            config.plan.object_store_gb_per_s))
        else:
            legs.append(Leg(f"rank 0 -> {len(engines)} engine(s) on its node", streamed * len(engines),
                            "NVLink / CUDA IPC", nvlink))
        spans = any(spans_nodes(gpus, gpn) for gpus in engines)
        workers = config.rollout.tensor_parallel_size
        if config.rollout.backend == "vllm" and workers > 1:
            if not config.plan.host_copy_gb_per_s > 0:
                raise UserError(f"plan.host_copy_gb_per_s={config.plan.host_copy_gb_per_s} is not a speed: give the "
                                "host memory copy speed of the GPU node in GB/s (12.8 unless set; bash "
                                "tests/gpu/run_gpu_checks.sh --tier cluster --only host-memcpy measures it)")
            # vLLM's collective_rpc pickles its arguments into host shared memory that every worker reads and
            # copies to its GPU (vllm/distributed/device_communicators/shm_broadcast.py): the whole bucket stream
            # passes host memory once per worker. sync.transport=broadcast writes into every worker over NCCL.
            legs.append(Leg(f"engine driver -> its {workers} workers through host memory (vLLM collective_rpc; "
                            "broadcast avoids it)", streamed * workers, "host memcpy, measured",
                            config.plan.host_copy_gb_per_s))
        else:
            legs.append(Leg("engine driver -> its other GPUs (collective_rpc)", streamed,
                            "InfiniBand" if spans else "NVLink", ib_per_gpu if spans else nvlink))
    return Refit(transport=transport, requested=config.sync.transport, bytes_per_sync=streamed, totals=totals, senders=senders,
                 engine_gpu_receives=streamed, legs=legs, adapters_only=adapters is not None)


def spans_nodes(gpus: list[int], gpus_per_node: int) -> bool:
    """Whether an engine's GPUs span more than one node."""
    return len({g // gpus_per_node for g in gpus}) > 1

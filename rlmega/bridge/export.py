"""A sharded Megatron model -> a stream of ``(hf_name, tensor)``, bucket by bucket.

Collective: every rank of the job calls ``export_hf_weights``; the ranks in ``destinations``
(default: all) receive every tensor. Each Megatron parameter is gathered once: its data-parallel
replica 0 gathers the tensor-parallel shards inside the TP group, converts them to HF tensors on
TP rank 0 (the owner), and the owner sends them to the destinations (a broadcast when that is
every rank), packed in buckets of at most ``bucket_bytes`` (a tensor larger than that travels alone). Peak extra memory per rank is about one bucket plus the largest tensor.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from rlmega.bridge.mapping import Geometry, RuleBook, to_hf
from rlmega.bridge.params import gathered_shape, geometry_of, local_params, tp_group_of
from rlmega.models.spec import ModelSpec

DEFAULT_BUCKET_BYTES = 256 * 1024**2


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One Megatron parameter as the HF tensors it becomes, announced by its owner rank."""

    canonical: str
    owner: int
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in self.tensors)


def exported_params(chunks: list, spec: ModelSpec):
    """{canonical: (param, rule, hf names, TP group, TP rank, TP size)} of the replica-0 params here."""
    from megatron.core import parallel_state as ps

    book = RuleBook(spec.architecture)
    exported = {}
    for param in local_params(chunks):
        if param.tied_output:
            continue  # the same tensor as the input embedding
        # Context-parallel ranks hold replicas too: dense params count them among the data-parallel ones.
        replica = ps.get_expert_data_parallel_rank() if param.is_expert else ps.get_data_parallel_rank(with_context_parallel=True)
        if replica != 0:
            continue
        rule, names = book.resolve(param.canonical)
        exported[param.canonical] = (param, rule, names, *tp_group_of(param))
    return exported


def gather_tp(param, group, tp_rank: int, tp: int) -> torch.Tensor:
    """The full tensor from its TP shards, built in place by one broadcast per shard.

    gloo's all-gather stages a second full-size copy; broadcasts write straight into their target,
    so gathering costs the full tensor plus at most one shard.
    """
    tensor = param.tensor.detach()
    if param.partition_dim is None or tp == 1:
        return tensor
    full = torch.empty(gathered_shape(param, tp), dtype=tensor.dtype, device=tensor.device)
    for shard_rank, block in enumerate(full.chunk(tp, dim=param.partition_dim)):
        target = block if block.is_contiguous() else torch.empty_like(tensor)
        if shard_rank == tp_rank:
            target.copy_(tensor)
        dist.broadcast(target, src=dist.get_global_rank(group, shard_rank), group=group)
        if target is not block:
            block.copy_(target)
    return full


# What a model's export is made of never changes (its parameters, their rules and names; the units' names, shapes
# and dtypes): worked out and announced once per model, by its first chunk. Every rank exports the same models in
# the same order, so all of them skip the announcement's collective together.
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[Callable, tuple[ModelSpec, dict, list]]]" = (
    weakref.WeakKeyDictionary())


def planned(chunks: list, spec: ModelSpec, announce: Callable[[dict, ModelSpec], list]) -> tuple[dict, list]:
    """``(exported_params, announce(exported_params, spec))`` of the model of ``chunks``, announced once (a
    collective) per model and kind of announcement."""
    plans = _PLANS.setdefault(chunks[0], {})
    known = plans.get(announce)
    if known is None or known[0] != spec:
        exported = exported_params(chunks, spec)
        known = plans[announce] = (spec, exported, announce(exported, spec))
    return known[1], known[2]


def announce_units(exported: dict, spec: ModelSpec, describe: Callable[[str, tuple, dict, Geometry], object]) -> list:
    """Every owner's units, in the same order on every rank (a collective): on the TP rank 0 of each parameter,
    ``describe(canonical, exported entry, its HF tensors on the meta device, geometry)``."""
    geometry = geometry_of(spec)
    mine = []
    for canonical, entry in exported.items():
        param, rule, names, _, tp_rank, tp = entry
        if tp_rank == 0:
            probe = torch.empty(gathered_shape(param, tp), dtype=param.tensor.dtype, device="meta")
            mine.append(describe(canonical, entry, to_hf(rule, probe, names, geometry, tp), geometry))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [unit for units in everyone for unit in units]


def _export_unit(canonical: str, entry: tuple, hf: dict, geometry: Geometry) -> _Unit:
    return _Unit(canonical, dist.get_rank(), tuple((n, tuple(t.shape), t.dtype) for n, t in hf.items()))


def _announce(exported: dict, spec: ModelSpec) -> list[_Unit]:
    return announce_units(exported, spec, _export_unit)


def bucketed(items: list, size_of: Callable[[object], int], bucket_bytes: int) -> Iterator[list]:
    """``items`` in order, grouped so that no group exceeds ``bucket_bytes`` unless one item alone does."""
    bucket, size = [], 0
    for item in items:
        if bucket and size + size_of(item) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += size_of(item)
    if bucket:
        yield bucket


def _fill(units: list[_Unit], exported: dict, geometry) -> Optional[torch.Tensor]:
    """Gather ``units`` in their TP groups; on their owner, return their HF tensors packed as bytes.

    A lone tensor is returned as it is (no packing copy), so a tensor larger than the bucket costs
    its own size once, not twice.
    """
    nbytes = sum(unit.nbytes for unit in units)
    buffer, offset = None, 0
    for unit in units:
        if unit.canonical not in exported:
            continue  # another TP group's (or pipeline stage's) parameter
        param, rule, names, group, tp_rank, tp = exported[unit.canonical]
        gathered = gather_tp(param, group, tp_rank, tp)
        if tp_rank != 0:
            continue
        for tensor in to_hf(rule, gathered, names, geometry, tp).values():
            if len(units) == 1 and len(unit.tensors) == 1:
                return tensor.contiguous()
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
            size = tensor.numel() * tensor.element_size()
            # Into a view of the buffer in the tensor's own dtype: a byte-wise copy moves the same bytes as 4x the elements.
            buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            offset += size
        del gathered
    return buffer


def _payload_device() -> torch.device:
    """Where payloads are packed and received: on the GPU where the default group has NCCL, which moves
    only CUDA tensors (and the CUDA IPC transport shares device buckets); on the CPU under gloo alone."""
    if "nccl" in str(dist.get_backend()):  # "nccl", or "cpu:gloo,cuda:nccl" (rlmega.parallel.layout)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _deliver(payload: Optional[torch.Tensor], owner: int, template: torch.Tensor, destinations) -> Optional[torch.Tensor]:
    """Move ``payload`` from ``owner`` to the destination ranks (all ranks when None); returns it
    on destinations, None elsewhere. ``template`` is an empty tensor of the payload's shape and dtype."""
    rank = dist.get_rank()
    if destinations is None:
        payload = payload if rank == owner else template
        dist.broadcast(payload, src=owner)
        return payload
    if rank == owner:
        for destination in destinations:
            if destination != owner:
                dist.send(payload, dst=destination)
        return payload if owner in destinations else None
    if rank in destinations:
        dist.recv(template, src=owner)
        return template
    return None


@torch.no_grad()
def export_hf_weights(
    chunks: list, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, destinations: Optional[Sequence[int]] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor of the model on each rank of ``destinations`` (every rank when None).

    Collective: every rank calls it and iterates to the end, destination or not, because the TP
    gathers need all of them; ranks outside ``destinations`` yield nothing.
    """
    for bucket in export_hf_buckets(chunks, spec, bucket_bytes=bucket_bytes, destinations=destinations):
        yield from bucket


@torch.no_grad()
def export_hf_buckets(
    chunks: list, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, destinations: Optional[Sequence[int]] = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``export_hf_weights`` one delivered payload at a time: a list of ``(hf_name, tensor)`` that
    share one buffer, yielded before the next payload is gathered (so a consumer that ships
    bucket n while the export builds bucket n+1 holds at most two)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if destinations is not None:
        destinations = sorted(set(destinations))
        invalid = [r for r in destinations if not 0 <= r < dist.get_world_size()]
        if invalid:
            raise ValueError(f"destinations {invalid} are not ranks of this job (world size {dist.get_world_size()})")
    geometry = geometry_of(spec)
    exported, units = planned(chunks, spec, _announce)
    device = _payload_device()
    for bucket in bucketed(units, lambda unit: unit.nbytes, bucket_bytes):
        for owner in sorted({unit.owner for unit in bucket}):
            units = [unit for unit in bucket if unit.owner == owner]
            payload = _fill(units, exported, geometry)
            if len(units) == 1 and len(units[0].tensors) == 1:
                name, shape, dtype = units[0].tensors[0]
                payload = _deliver(payload, owner, torch.empty(shape, dtype=dtype, device=device), destinations)
                if payload is not None:
                    yield [(name, payload)]
                continue
            template = torch.empty(sum(unit.nbytes for unit in units), dtype=torch.uint8, device=device)
            payload = _deliver(payload, owner, template, destinations)
            if payload is None:
                continue
            tensors, offset = [], 0
            for unit in units:
                for name, shape, dtype in unit.tensors:
                    size = torch.Size(shape).numel() * dtype.itemsize
                    tensors.append((name, payload[offset : offset + size].view(dtype).view(shape)))
                    offset += size
            yield tensors

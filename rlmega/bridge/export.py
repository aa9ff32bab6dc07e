"""A sharded Megatron model -> a stream of ``(hf_name, tensor)``, bucket by bucket.

Collective: every rank of the job calls ``export_hf_weights`` and receives every tensor. Each
Megatron parameter is gathered once: its data-parallel replica 0 all-gathers the tensor-parallel
shards inside the TP group, converts them to HF tensors on TP rank 0 (the owner), and the owner
broadcasts them to all ranks packed in buckets of at most ``bucket_bytes`` (a tensor larger than
that travels alone). Peak extra memory per rank is about one bucket plus the largest tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist

from rlmega.bridge.mapping import RuleBook, to_hf
from rlmega.bridge.params import geometry_of, local_params, tp_group_of
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


def _exported_params(chunks: list, spec: ModelSpec):
    """{canonical: (param, rule, hf names, TP group, TP rank, TP size)} of the replica-0 params here."""
    from megatron.core import parallel_state as ps

    book = RuleBook(spec.architecture)
    exported = {}
    for param in local_params(chunks):
        if param.tied_output:
            continue  # the same tensor as the input embedding
        replica = ps.get_expert_data_parallel_rank() if param.is_expert else ps.get_data_parallel_rank()
        if replica != 0:
            continue
        rule, names = book.resolve(param.canonical)
        exported[param.canonical] = (param, rule, names, *tp_group_of(param))
    return exported


def _gather(param, group, tp: int) -> torch.Tensor:
    tensor = param.tensor.detach()
    if param.partition_dim is None or tp == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=param.partition_dim)


def _announce(exported: dict, spec: ModelSpec) -> list[_Unit]:
    """Every owner's units, in the same order on every rank."""
    geometry, rank = geometry_of(spec), dist.get_rank()
    mine = []
    for canonical, (param, rule, names, _, tp_rank, tp) in exported.items():
        if tp_rank != 0:
            continue
        shape = list(param.tensor.shape)
        if param.partition_dim is not None:
            shape[param.partition_dim] *= tp
        probe = torch.empty(shape, dtype=param.tensor.dtype, device="meta")
        hf = to_hf(rule, probe, names, geometry, tp)
        mine.append(_Unit(canonical, rank, tuple((n, tuple(t.shape), t.dtype) for n, t in hf.items())))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [unit for units in everyone for unit in units]


def _buckets(units: list[_Unit], bucket_bytes: int) -> Iterator[list[_Unit]]:
    bucket, size = [], 0
    for unit in units:
        if bucket and size + unit.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += unit.nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def export_hf_weights(chunks: list, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor of the model on every rank (see the module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    geometry = geometry_of(spec)
    exported = _exported_params(chunks, spec)
    for bucket in _buckets(_announce(exported, spec), bucket_bytes):
        packed: dict[int, list[torch.Tensor]] = {}
        for unit in bucket:
            if unit.canonical not in exported:
                continue
            param, rule, names, group, tp_rank, tp = exported[unit.canonical]
            gathered = _gather(param, group, tp)
            if tp_rank == 0:
                hf = to_hf(rule, gathered, names, geometry, tp)
                packed.setdefault(unit.owner, []).extend(t.contiguous().view(-1).view(torch.uint8) for t in hf.values())
        for owner in sorted({unit.owner for unit in bucket}):
            units = [unit for unit in bucket if unit.owner == owner]
            nbytes = sum(unit.nbytes for unit in units)
            buffer = torch.cat(packed[owner]) if owner == dist.get_rank() else torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(buffer, src=owner)
            offset = 0
            for unit in units:
                for name, shape, dtype in unit.tensors:
                    size = torch.Size(shape).numel() * dtype.itemsize
                    yield name, buffer[offset : offset + size].view(dtype).view(shape)
                    offset += size

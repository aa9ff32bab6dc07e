"""Buckets of ``(hf_name, tensor)`` packed into one flat byte buffer, and read back as views.

The metadata (``TensorMeta``) is all a receiver needs besides the bytes: names, dtypes, shapes and
offsets. Offsets are aligned so every view is aligned for its dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch

ALIGN_BYTES = 64

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def nbytes_of(bucket: NamedTensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)


def layout(bucket: NamedTensors) -> tuple[list[TensorMeta], int]:
    """Where each tensor of ``bucket`` goes in a flat buffer, and the buffer's size in bytes."""
    metas, offset = [], 0
    for name, tensor in bucket:
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    return metas, offset


def pack(bucket: NamedTensors, metas: list[TensorMeta], flat: torch.Tensor) -> None:
    """Copy ``bucket`` into the uint8 tensor ``flat`` (on any device) as ``metas`` says."""
    for (_, tensor), meta in zip(bucket, metas):
        target = flat[meta.offset : meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)
        target.copy_(tensor, non_blocking=True)


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of the tensors packed in ``flat``: valid until ``flat`` is reused."""
    for meta in metas:
        yield meta.name, flat[meta.offset : meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)


def rebucket(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group a stream into buckets, each handed on as soon as it reaches ``bucket_bytes`` (so no
    tensor of the next bucket is pulled from the stream before this one leaves)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket

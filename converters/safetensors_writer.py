"""Sharded safetensors written as a stream: every shard's header is known before any data, because
the converter plans every tensor's name, shape and dtype up front. So shards can be as large as
asked while memory holds one bucket, and each file is written once, front to back.

File format (safetensors): an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (padded with spaces to a multiple of 8), then the raw bytes
in header order. ``model.safetensors.index.json`` maps every tensor to its shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO, Optional

import torch

INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive runs of ``entries`` of at most ``max_shard_bytes`` (a larger tensor: alone)."""
    shards, current, size = [], [], 0
    for entry in entries:
        if current and size + entry.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current:
        shards.append(current)
    return shards


def _header(entries: list[Entry]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        header[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class ShardedSafetensorsWriter:
    """Writes ``entries`` into ``directory`` as ``model-0000i-of-0000n.safetensors`` plus the index.

    ``write`` must be called once per entry, in the planned order; ``close`` checks that every
    entry came and writes the index. Files are fsynced before they count as written.
    """

    def __init__(self, directory: Path, entries: list[Entry], max_shard_bytes: int):
        self.directory = Path(directory)
        self.shards = plan_shards(entries, max_shard_bytes)
        count = len(self.shards)
        self.file_names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.order = [(shard, entry) for shard, shard_entries in enumerate(self.shards) for entry in shard_entries]
        self.total_bytes = sum(entry.nbytes for entry in entries)
        self._next = 0
        self._file: Optional[BinaryIO] = None
        self._open_shard = -1

    @property
    def planned_bytes(self) -> int:
        """Bytes on disk: data plus headers."""
        return self.total_bytes + sum(len(_header(entries)) for entries in self.shards)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, entry = self.order[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise AssertionError(f"expected {entry} next, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        if shard != self._open_shard:
            self._close_file()
            self._file = open(self.directory / self.file_names[shard], "wb")
            self._file.write(_header(self.shards[shard]))
            self._open_shard = shard
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._next != len(self.order):
            missing = self.order[self._next][1].name
            raise AssertionError(f"{len(self.order) - self._next} tensor(s) never written, first {missing}")
        self._close_file()
        weight_map = {entry.name: self.file_names[shard] for shard, entry in self.order}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

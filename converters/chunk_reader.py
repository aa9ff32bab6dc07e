"""A ``FileSystemReader`` that reads whole stored chunks straight into their destination.

``torch.distributed.checkpoint`` stores each chunk as a ``torch.save`` archive (an uncompressed
zip) inside a ``.distcp`` file, and its reader unpickles every chunk into a fresh tensor and then
copies it into the destination: two extra passes over memory per byte. Where a request covers a
whole stored chunk and its destination is contiguous, this reader finds the chunk's raw bytes in
the archive and reads them into the destination directly. It does so only when the archive says
exactly what is expected (one little-endian, uncompressed, contiguous storage of the right dtype
and size); anything else goes through torch's own reader, so results never differ, only speed.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.futures import Future

from rlmega.bridge.torch_dist_files import FileSlice

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
_LOCAL_HEADER = 30  # zip local file header: fixed part; name and extra field follow


class _TensorPickle(pickle.Unpickler):
    """Unpickles a ``torch.save``'d tensor into its layout only: (storage name, storage key,
    storage numel, storage offset, size, stride). Anything else in the pickle is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (*storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid):
        kind, storage_name, key, _, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        return storage_name, key, numel


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for length in reversed(size):
        strides.append(step)
        step *= length
    return tuple(reversed(strides))


def locate_tensor_bytes(stream, offset: int, length: int, size: tuple[int, ...], dtype: torch.dtype) -> Optional[int]:
    """Where, from ``offset``, the raw bytes of the ``torch.save``'d tensor stored at ``[offset,
    offset + length)`` of ``stream`` begin; None unless it is exactly one contiguous, uncompressed,
    little-endian ``dtype`` tensor of ``size``."""
    view = FileSlice(stream, offset, length)
    try:
        with zipfile.ZipFile(view) as archive:
            [pickled] = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            prefix = pickled[: -len("data.pkl")]
            if prefix + "byteorder" in archive.namelist() and archive.read(prefix + "byteorder") != b"little":
                return None
            storage_name, key, numel, storage_offset, stored_size, stride = _TensorPickle(io.BytesIO(archive.read(pickled))).load()
            record = archive.getinfo(f"{prefix}data/{key}")
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError, EOFError):
        return None
    expected = math.prod(size)
    if (_STORAGE_DTYPES[storage_name] != dtype or stored_size != tuple(size) or storage_offset != 0
            or stride != _contiguous_strides(tuple(size)) or numel != expected
            or record.compress_type != zipfile.ZIP_STORED or record.file_size != expected * dtype.itemsize
            or record.header_offset + _LOCAL_HEADER > length):
        return None
    view.seek(record.header_offset)
    header = view.read(_LOCAL_HEADER)
    if len(header) != _LOCAL_HEADER or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start = record.header_offset + _LOCAL_HEADER + name_length + extra_length
    return start if start + record.file_size <= length else None


class DirectChunkReader(dcp.FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` once and whole chunks without the extra copy."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rest = []
        for relative_path, items in by_file.items():
            with open(os.path.join(self.path, relative_path), "rb", buffering=0) as stream:
                rest += [item for item in items if not self._read_whole_chunk(stream, item, planner)]
        if rest:
            return super().read_data(LoadPlan(rest), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_whole_chunk(self, stream, item, planner) -> bool:
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors or any(item.storage_offsets):
            return False
        stored = self._metadata.state_dict_metadata[item.storage_index.fqn]
        chunks = [c for c in stored.chunks if tuple(c.offsets) == tuple(item.storage_index.offset)]
        if len(chunks) != 1 or tuple(item.lengths) != tuple(chunks[0].sizes):
            return False
        chunk = chunks[0]
        target = planner.resolve_tensor(item)
        if not target.is_contiguous():
            return False
        start = locate_tensor_bytes(stream, info.offset, info.length, tuple(chunk.sizes), stored.properties.dtype)
        if start is None:
            return False
        data = memoryview(target.view(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        stream.seek(info.offset + start)
        filled = 0
        while filled < len(data):
            count = stream.readinto(data[filled:])
            if not count:
                raise EOFError(f"{stream.name} ends inside a stored tensor")
            filled += count
        planner.commit_tensor(item, target)
        return True

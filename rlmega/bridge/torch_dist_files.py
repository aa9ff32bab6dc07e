"""The files of a Megatron ``torch_dist`` checkpoint directory, checked so that a torn one is named on one line.

A directory holds ``.metadata`` (the pickled index: which byte range of which ``.distcp`` file holds each stored
chunk), the ``.distcp`` files (each chunk a ``torch.save`` zip archive at its offset), ``common.pt`` (what every rank
shares; from Megatron-Core 0.19 a ``common_state`` chunk of the ``.distcp`` files instead) and ``metadata.json`` (the backend). Before a load, ``check_files`` makes sure that every file the index
names exists and is as long as the index says (a stat per file). After a load failed, ``find_damage`` reads every
file whole and checks each archive's CRC-32s, to name the file whose bytes are wrong: a full read, so only then.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import Optional

from rlmega.bridge.hf_checkpoint import CheckpointError

INDEX = ".metadata"
COMMON = "common.pt"
COMMON_OBJECT = "common_state/shard_0_1"  # Megatron-Core 0.19's home of the common state: a ShardedObject's key
BACKEND = "metadata.json"


class FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of ``stream`` as a seekable file of their own."""

    def __init__(self, stream, offset: int, length: int):
        self.stream, self.offset, self.length, self.position = stream, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        self.position = min(max(base + offset, 0), self.length)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.length - self.position)
        self.stream.seek(self.offset + self.position)
        read = self.stream.readinto(memoryview(buffer)[:count])
        self.position += read
        return read


def _reason(error: BaseException) -> str:
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def read_index(directory: Path, reader=None):
    """The checkpoint's index (``.metadata``), read by ``reader`` (a ``FileSystemReader`` of ``directory`` by
    default); CheckpointError naming the file when it is missing or cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(directory) / INDEX
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {INDEX}; it is not a complete torch_dist checkpoint, copy it again")
    try:
        return (reader or FileSystemReader(str(directory))).read_metadata()
    except Exception as error:  # pickle's and torch's errors for a cut or garbled index
        raise CheckpointError(f"{path} is damaged ({_reason(error)}); copy the checkpoint again from the original") \
            from None


def read_backend(directory: Path) -> Optional[dict]:
    """``metadata.json`` (which strategy saved the checkpoint), None when there is none; CheckpointError naming it
    when it cannot be read."""
    path = Path(directory) / BACKEND
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise CheckpointError(f"{path} is damaged ({_reason(error)}); copy the checkpoint again from the original") \
            from None


def check_files(directory: Path, index, keys: Optional[set[str]] = None) -> None:
    """CheckpointError naming the first ``.distcp`` file that the index lists for ``keys`` (None: for every stored
    entry) and that is missing, or shorter than the index says."""
    needed: dict[str, int] = {}
    for storage, info in index.storage_data.items():
        if keys is None or storage.fqn in keys:
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(f"shard file {name} of {directory} is missing (listed in {INDEX}); copy the complete "
                                  "checkpoint directory")
        size = path.stat().st_size
        if size < length:
            raise CheckpointError(f"shard file {path} is truncated ({size} bytes, {INDEX} says at least {length}); "
                                  "copy it again from the original checkpoint")


def _archive_damage(stream, offset: int, length: int) -> Optional[str]:
    """Why the ``torch.save`` archive at ``[offset, offset + length)`` of ``stream`` is damaged; None if it reads back
    whole (every member's CRC-32 as written)."""
    try:
        with zipfile.ZipFile(FileSlice(stream, offset, length)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as error:
        return _reason(error)
    return None if bad is None else f"the CRC-32 of its member {bad} does not match its bytes"


def read_common(directory: Path) -> dict:
    """What every rank shares (Megatron's common state: ``content_metadata`` among it), in either of its homes:
    ``common.pt`` (Megatron-Core up to 0.18) or the ``common_state`` object inside the checkpoint's own files (0.19
    writes no ``common.pt``). Read from the files, whichever megatron-core is installed, so a checkpoint of either
    release converts on both; {} when there is none, or when it holds objects a weights-only load refuses
    (Megatron-LM pickles its argparse Namespace there: nothing rlmega wrote)."""
    import pickle

    import torch

    directory = Path(directory)
    if (directory / COMMON).is_file():
        check_common(directory)  # a torn common.pt would pass as one without a record
        source, where = directory / COMMON, f"{directory / COMMON}"
    else:
        index = read_index(directory)
        key = next((key for key in index.storage_data if key.fqn == COMMON_OBJECT), None)
        if key is None:
            return {}
        info = index.storage_data[key]
        check_files(directory, index, {COMMON_OBJECT})
        where = f"shard file {directory / info.relative_path}"
        with open(directory / info.relative_path, "rb") as stream:
            why = _archive_damage(stream, info.offset, info.length)  # else zeroed bytes would read as "no record"
            if why:
                raise CheckpointError(f"{where} is damaged ({why}, in the common state); copy the checkpoint again "
                                      "from the original")
            stream.seek(info.offset)
            source = io.BytesIO(stream.read(info.length))
    try:
        common = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return {}
    except Exception as error:  # zip and pickle errors of cut or garbled bytes
        raise CheckpointError(f"{where} is damaged ({_reason(error)}, in the common state); copy the checkpoint "
                              "again from the original") from None
    if isinstance(common, (list, tuple)) and common:  # a ShardedObject's data is saved as a one-element list
        common = common[0]
    return common if isinstance(common, dict) else {}


def check_common(directory: Path) -> None:
    """CheckpointError naming ``common.pt`` when it is there but does not read back whole (it is small: read whole)."""
    common = Path(directory) / COMMON
    if common.is_file():
        with open(common, "rb") as stream:
            why = _archive_damage(stream, 0, common.stat().st_size)
        if why:
            raise CheckpointError(f"{common} is damaged ({why}); copy the checkpoint again from the original")


def find_damage(directory: Path) -> Optional[str]:
    """``"<file> is damaged (<why>)"`` for the first file of the checkpoint in ``directory`` that does not read back
    whole (``metadata.json``, ``common.pt``, ``.metadata``, each ``.distcp``: missing, short, or an archive whose
    CRC-32s do not match); None when every file does. Reads every file whole."""
    directory = Path(directory)
    try:
        read_backend(directory)
        check_common(directory)
        index = read_index(directory)
        check_files(directory, index)
    except CheckpointError as error:
        return str(error).split("; ")[0]
    by_file: dict[str, list] = {}
    for info in index.storage_data.values():
        if not getattr(info, "transform_descriptors", None):  # transformed (compressed) chunks are not archives
            by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        with open(directory / name, "rb") as stream:
            for info in sorted(infos, key=lambda info: info.offset):
                why = _archive_damage(stream, info.offset, info.length)
                if why:
                    return f"shard file {directory / name} is damaged ({why}, in the chunk at byte {info.offset})"
    return None

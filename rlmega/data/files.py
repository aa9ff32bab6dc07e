"""Reading and writing dataset files: parquet and JSON lines, one row per record."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from rlmega.data.schema import DataFormatError
from rlmega.errors import UserError

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")


class OutOfMemoryError(UserError):
    """A dataset file that does not fit in the memory this process may use; the message names the file."""


def _suffix(path: str) -> str:
    for suffix in SUPPORTED_SUFFIXES:
        if path.endswith(suffix):
            return suffix
    raise DataFormatError(f"{path}: unsupported file type; supported: {list(SUPPORTED_SUFFIXES)}")


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``.parquet`` or ``.jsonl`` file as dicts (nested structs become dicts, lists stay lists);
    an empty file has none. A file that cannot be read raises DataFormatError naming the file and line, one that
    does not fit in memory OutOfMemoryError naming the file."""
    path = os.fspath(path)
    suffix = _suffix(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if os.path.getsize(path) == 0:
        return []
    try:
        return _read_parquet(path) if suffix == ".parquet" else _read_jsonl(path)
    except MemoryError as error:
        raise out_of_memory(path, error) from None


def out_of_memory(path: str, error: MemoryError) -> OutOfMemoryError:
    """The one-line error of a ``MemoryError`` met while reading (or tokenizing) the dataset file ``path``."""
    return OutOfMemoryError(
        f"out of memory while reading {path}: {_first_line(error) or 'an allocation failed'}; raise the process's "
        "memory limit (ulimit -v, the job's memory request) or split the file into smaller ones")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def _read_parquet(path: str) -> list[dict[str, Any]]:
    # pyarrow's default allocator (mimalloc) reserves about 1 GB of address space at its first allocation, which an
    # address-space limit (ulimit -v) counts in full; prompt files are small and read once, and the system
    # allocator reserves what it uses. It applies when pyarrow has not allocated yet, and unless the user chose.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # One file, read on this thread: pyarrow's dataset scanner (read_table) waits forever on a thread pool
        # whose threads could not start under an address-space limit (ulimit -v), deaf to Ctrl-C.
        return pq.ParquetFile(path).read(use_threads=False).to_pylist()
    except pa.ArrowMemoryError:  # also a MemoryError; caught by the caller
        raise
    except (pa.ArrowException, OSError) as error:
        reason = _first_line(error) or type(error).__name__
        raise DataFormatError(f"{path}: not a readable parquet file ({reason})") from None


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    offset = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            start = len(codecs.BOM_UTF8) if line_number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                line = raw[start:].decode("utf-8")
            except UnicodeDecodeError as error:
                position = offset + start + error.start
                raise DataFormatError(
                    f"{path} line {line_number}: not UTF-8 (byte 0x{raw[start + error.start]:02x} at byte offset "
                    f"{position} of the file); save the file as UTF-8"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataFormatError(
                    f"{path} line {line_number}: not valid JSON ({error.msg} at column {error.colno}); "
                    "each line must hold one JSON object"
                ) from None
    return rows


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Write rows to ``.parquet`` or ``.jsonl`` (chosen by the suffix); returns the path written."""
    path = os.fspath(path)
    suffix = _suffix(path)
    rows = [dict(row) for row in rows]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise DataFormatError(
                f"{path}: the rows do not fit one parquet table ({error}); a column must have one type in every row, "
                "e.g. write datasets whose ground truths differ in type to separate files"
            ) from None
        pq.write_table(table, path)
    else:
        with open(path, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path

"""Reading and writing dataset files: parquet and JSON lines, one row per record."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from rlmega.data.schema import DataFormatError

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")


def _suffix(path: str) -> str:
    for suffix in SUPPORTED_SUFFIXES:
        if path.endswith(suffix):
            return suffix
    raise DataFormatError(f"{path}: unsupported file type; supported: {list(SUPPORTED_SUFFIXES)}")


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``.parquet`` or ``.jsonl`` file as dicts (nested structs become dicts, lists stay lists)."""
    path = os.fspath(path)
    suffix = _suffix(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataFormatError(f"{path} line {line_number}: not valid JSON ({error})") from None
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

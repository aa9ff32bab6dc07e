"""Output directories that appear only when complete, checked up front for room and for clobbering.

A conversion writes into a hidden sibling, ``.<name>.partial-<pid>``, and renames it to ``<name>``
when everything is written and fsynced. An error or Ctrl-C removes the sibling; a process killed
outright leaves only the hidden ``.partial`` directory, never one under the output's name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from converters.errors import ConversionError

DISK_MARGIN = 1.02
"""Space asked for beyond the estimate (filesystem overhead, small files)."""


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """``"256MiB"``, ``"2GB"``, ``"1048576"`` -> bytes (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)."""
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
             "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if cleaned.endswith(unit) and cleaned[: -len(unit)]:
            number = cleaned[: -len(unit)]
            break
    else:
        number, factor = cleaned, 1
    try:
        value = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"{text!r} is not a size; write e.g. 512MiB, 2GiB or a number of bytes") from None
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive size")
    return value


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``."""
    if path.exists() and not overwrite:
        raise ConversionError(f"output {path} already exists; pass --overwrite to replace it, or choose another path")
    if path.exists() and not path.is_dir():
        raise ConversionError(f"output {path} exists and is not a directory; remove it or choose another path")


def check_disk_space(path: Path, needed_bytes: int, what: str = "the output") -> None:
    """Raise ConversionError unless the filesystem that will hold ``path`` has room for ``needed_bytes``."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    wanted = int(needed_bytes * DISK_MARGIN)
    if free < wanted:
        raise ConversionError(
            f"not enough disk space for {what} at {probe}: about {human_bytes(wanted)} needed, "
            f"{human_bytes(free)} free; free some space or write to another filesystem"
        )


@contextlib.contextmanager
def atomic_directory(path: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty hidden sibling of ``path`` to write into; rename it to ``path`` on success."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    try:
        yield partial
        _fsync_directory(partial)
        _replace(partial, path, overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _replace(partial: Path, path: Path, overwrite: bool) -> None:
    old: Optional[Path] = None
    if path.exists():
        check_output(path, overwrite)
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_directory(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist yet)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total

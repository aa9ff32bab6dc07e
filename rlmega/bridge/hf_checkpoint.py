"""Read slices of an HF safetensors checkpoint without loading whole files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: it does not match what the model needs, or one of its files is missing or
    damaged; the message names the key or the file."""


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _open_shard(path: Path, listed_key: str, directory: Path):
    """A safetensors handle of ``path``; CheckpointError naming the file if it is missing or cannot be read (safetensors
    checks the header and that the data it describes fits the file: truncated or garbled files fail here)."""
    if not path.exists():
        raise CheckpointError(f"{listed_key!r} is listed in {path.name}, which does not exist in {directory} (a "
                              "missing shard); copy the complete model directory")
    try:
        return safe_open(path, "pt")
    except Exception as error:  # safetensors' SafetensorError (a plain Exception), or an OSError
        reason = " ".join(str(error).split()) or type(error).__name__
        raise CheckpointError(f"{path} is damaged ({reason}); copy that file again from where the model came from") \
            from None


class HFCheckpoint:
    """The tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    Every file is opened (its header read) when the checkpoint is: a missing, truncated or garbled shard is named
    before any tensor is read."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index} is damaged ({type(error).__name__}: {error}); copy it again from where "
                                      "the model came from") from None
        elif single.exists():
            weight_map = {key: single.name for key in _open_shard(single, SINGLE, self.directory).keys()}
        else:
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE} nor {INDEX}")
        self.files = {key: self.directory / name for key, name in weight_map.items()}
        first_key = {}
        for key, path in self.files.items():
            first_key.setdefault(path, key)
        self._handles = {path: _open_shard(path, key, self.directory) for path, key in sorted(first_key.items())}

    def keys(self) -> set[str]:
        return set(self.files)

    def _handle(self, key: str):
        if key not in self.files:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key!r}")
        return self._handles[self.files[key]]

    def _slice(self, key: str):
        try:
            return self._handle(key).get_slice(key)
        except CheckpointError:
            raise
        except Exception as error:  # a key the index lists in a shard that does not hold it
            reason = " ".join(str(error).split())
            raise CheckpointError(f"{self.files[key]} does not hold {key!r}, though {INDEX} says so ({reason}); copy "
                                  "the complete model directory again") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        """``tensor[rows, cols]`` read from disk; None takes the whole dimension."""
        view = self._slice(key)
        if rows is None and cols is None:
            return view[:]
        if cols is None:
            return view[rows]
        return view[rows if rows is not None else slice(None), cols]

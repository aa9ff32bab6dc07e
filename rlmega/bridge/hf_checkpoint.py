"""Read slices of an HF safetensors checkpoint without loading whole files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint does not match what the model needs; the message names the key."""


class HFCheckpoint:
    """The tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.exists():
            with safe_open(single, "pt") as handle:
                weight_map = {key: single.name for key in handle.keys()}
        else:
            raise FileNotFoundError(f"{self.directory} has neither model.safetensors nor model.safetensors.index.json")
        self.files = {key: self.directory / name for key, name in weight_map.items()}
        self._handles: dict[Path, object] = {}

    def keys(self) -> set[str]:
        return set(self.files)

    def _handle(self, key: str):
        if key not in self.files:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key!r}")
        path = self.files[key]
        if path not in self._handles:
            if not path.exists():
                raise CheckpointError(f"{key!r} is listed in {path.name}, which does not exist in {self.directory}")
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        """``tensor[rows, cols]`` read from disk; None takes the whole dimension."""
        view = self._handle(key).get_slice(key)
        if rows is None and cols is None:
            return view[:]
        if cols is None:
            return view[rows]
        return view[rows if rows is not None else slice(None), cols]

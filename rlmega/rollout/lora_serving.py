"""An engine serving a LoRA actor's adapters over base weights it loaded once (``sync.lora=adapters``), whichever
engine applies them (vLLM: ``rlmega.rollout.vllm_lora``; SGLang: ``rlmega.rollout.sglang_engine``).

Each weight update carries the adapter as a PEFT adapter in tensors: ``base_model.model.<HF module>.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (rlmega.workers.lora_export), and its ``adapter_config.json`` as one
uint8 tensor of that name (``config_tensor``), so every bucket transport carries it unchanged. Base weights in the same
stream (the base a warm-start folded the adapters into) load as in any update. At the commit the adapter is written
as a PEFT directory (under a temporary name, then renamed), the engine loads it from there under a name of its own,
and the one before is unloaded and removed (``ServedAdapter``). Both engines read the directory as PEFT writes it:
``r`` and ``lora_alpha`` from the config, scale ``lora_alpha / r``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Generic, Optional, TypeVar

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

Handle = TypeVar("Handle")


def is_adapter_name(name: str) -> bool:
    """Whether a streamed name belongs to the adapter (its tensors or its config), not to the base model."""
    return name == ADAPTER_CONFIG or name.startswith(PEFT_PREFIX)


def config_tensor(config: dict) -> torch.Tensor:
    """``adapter_config.json`` as a uint8 tensor, so that it travels in a stream of named tensors."""
    return torch.frombuffer(bytearray(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)


def config_of(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())


class AdapterFiles:
    """The adapter an update brings (``take``), and the PEFT directories the engine loads, each written once, under
    ``root`` (default: a directory of its own in /dev/shm where it exists, removed with this object)."""

    def __init__(self, root: Optional[str] = None):
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._owned = None if root else tempfile.TemporaryDirectory(prefix="rlmega-lora-", dir=shm)
        self.root = Path(root or self._owned.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_config: Optional[dict] = None

    def take(self, named_tensors):
        """The base weights of a stream, passed on; the adapter's tensors kept for the commit (copied: a transport
        may reuse its buffers)."""
        for name, tensor in named_tensors:
            if name == ADAPTER_CONFIG:
                self.pending_config = config_of(tensor)
            elif name.startswith(PEFT_PREFIX):
                self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
            else:
                yield name, tensor

    def drop_pending(self) -> None:
        self.pending, self.pending_config = {}, None

    def has_pending(self) -> bool:
        return bool(self.pending) or self.pending_config is not None

    def write(self, name: str) -> Path:
        """The pending adapter as PEFT directory ``root/name``, written under a temporary name and renamed."""
        from safetensors.torch import save_file

        tensors, config = self.pending, self.pending_config
        self.drop_pending()
        if config is None or not tensors:
            raise ValueError(f"the update's adapter is incomplete: it carried {len(tensors)} adapter tensors and "
                             f"{'an' if config else 'no'} {ADAPTER_CONFIG}; a sync with sync.lora=adapters sends both")
        final, partial = self.root / name, self.root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        save_file(tensors, str(partial / ADAPTER_WEIGHTS))
        (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.replace(partial, final)
        return final

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)


class ServedAdapter(Generic[Handle]):
    """The one adapter an engine applies to every request, and the weight version it came with.

    ``load(number, name, path)`` has the engine load the PEFT directory ``path`` as its ``number``-th adapter (from
    1, never reused: vLLM keeps adapters by id, SGLang refuses a name it has loaded) and returns the engine's handle
    of it (``current``), which requests then name; ``unload(handle)`` drops one from the engine."""

    def __init__(self, load: Callable[[int, str, Path], Handle], unload: Callable[[Handle], None],
                 root: Optional[str] = None):
        self.files = AdapterFiles(root)
        self._load, self._unload = load, unload
        self.current: Optional[Handle] = None
        """The handle every request names (None: the base model alone)."""
        self._current_name: Optional[str] = None
        self._served = 0

    def take(self, named_tensors):
        return self.files.take(named_tensors)

    def begin(self) -> None:
        """A new update: what a failed one brought never loads."""
        self.files.drop_pending()

    def has_pending(self) -> bool:
        return self.files.has_pending()

    def serve(self, version: int) -> None:
        """The pending adapter written, loaded as a new adapter of the engine, then the previous one unloaded and
        its directory removed."""
        self._served += 1
        name = f"rlmega-{self._served}-v{version}"
        handle = self._load(self._served, name, self.files.write(name))
        previous_name, previous = self._current_name, self.current
        self._current_name, self.current = name, handle
        if previous_name is not None:
            self._unload(previous)
            self.files.remove(previous_name)

"""Moving a worker's parameters, gradient buffers and optimizer state to host memory and back.

Works on storages, not tensors: Megatron's gradient buffers are flat storages that every
``param.main_grad`` views, and the distributed optimizer's parameters view a flat parameter buffer.
Releasing a storage (``resize_(0)``) frees the device memory behind all its views at once, and
resizing it back and copying the saved bytes restores every view bit for bit, without rebuilding
any module or optimizer object.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch

from rlmega.workers.optimizer_state import sub_optimizers


@dataclasses.dataclass
class _Saved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8 copy of the storage's bytes


def _storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    seen = set()
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        yield storage


def model_tensors(chunks: list) -> Iterator[torch.Tensor]:
    """Parameters, buffers and DDP gradient buffers of the model chunks."""
    for chunk in chunks:
        yield from torch.nn.Module.parameters(chunk)
        yield from torch.nn.Module.buffers(chunk)
        # Megatron's DDP keeps its gradient buffers in a list attribute that shadows Module.buffers.
        grad_buffers = chunk.buffers if isinstance(chunk.buffers, list) else []
        for buffer in grad_buffers + list(getattr(chunk, "expert_parallel_buffers", [])):
            yield buffer.grad_data
            if buffer.param_data is not None:
                yield buffer.param_data


def optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Master parameters and state (Adam moments) of a Megatron optimizer, chained or not."""
    for inner in sub_optimizers(optimizer):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            yield from group["params"]
        for state in torch_optimizer.state.values():
            yield from state.values()


class HostOffload:
    """Holds what ``offload`` moved out until ``onload`` brings it back."""

    def __init__(self):
        self._saved: list[_Saved] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct storage to host memory and release it; the bytes moved."""
        if self._saved:
            raise RuntimeError("already offloaded; call onload first")
        moved = 0
        pin = torch.cuda.is_available()
        for storage in list(_storages(tensors)):
            if pin and storage.device.type == "cpu":
                continue  # already in host memory (a CPU-offloaded optimizer's state)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(storage)
            self._saved.append(_Saved(storage, host))
            moved += storage.nbytes()
            storage.resize_(0)
        return moved

    def onload(self) -> int:
        """Restore every released storage from its host copy; the bytes moved."""
        moved = 0
        for saved in self._saved:
            saved.storage.resize_(saved.host.numel())
            saved.storage.copy_(saved.host.untyped_storage())
            moved += saved.host.numel()
        self._saved = []
        return moved

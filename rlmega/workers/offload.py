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


def parameter_tensors(chunks: list) -> Iterator[torch.Tensor]:
    """Parameters, buffers and DDP parameter buffers of the model chunks."""
    for chunk in chunks:
        yield from torch.nn.Module.parameters(chunk)
        yield from torch.nn.Module.buffers(chunk)
        for buffer in _ddp_buffers(chunk):
            if buffer.param_data is not None:
                yield buffer.param_data


def model_tensors(chunks: list) -> Iterator[torch.Tensor]:
    """Parameters, buffers and DDP parameter and gradient buffers of the model chunks."""
    yield from parameter_tensors(chunks)
    yield from gradient_tensors(chunks)


def _ddp_buffers(chunk) -> list:
    # Megatron's DDP keeps its gradient buffers in a list attribute that shadows Module.buffers.
    grad_buffers = chunk.buffers if isinstance(chunk.buffers, list) else []
    return grad_buffers + list(getattr(chunk, "expert_parallel_buffers", []))


def gradient_tensors(chunks: list) -> Iterator[torch.Tensor]:
    """The DDP gradient buffers of the model chunks (every ``param.main_grad`` views one)."""
    for chunk in chunks:
        for buffer in _ddp_buffers(chunk):
            yield buffer.grad_data


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


class TrainingState:
    """What only an update needs, out of the device while the engines take a weight sync (colocated): the
    gradient buffers are released without a copy (every update zeroes them before its first backward pass, so
    nothing is lost) and the optimizer's state (fp32 master weights, Adam moments) goes to host memory. The
    parameters, which the export reads, stay; so does any optimizer tensor that is a parameter's own storage
    (an fp32 model's optimizer steps the parameters themselves)."""

    def __init__(self):
        self._optimizer = HostOffload()
        self._gradients: list[tuple[torch.UntypedStorage, int]] = []

    @property
    def released(self) -> bool:
        return self._optimizer.active or bool(self._gradients)

    def release(self, chunks: list, optimizer) -> int:
        """The device bytes freed."""
        if self.released:
            raise RuntimeError("training state already released; call restore first")
        parameters = {storage.data_ptr() for storage in _storages(parameter_tensors(chunks))}
        state = [t for t in optimizer_tensors(optimizer) if t.untyped_storage().data_ptr() not in parameters]
        freed = self._optimizer.offload(state)
        for storage in list(_storages(gradient_tensors(chunks))):
            self._gradients.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    def restore(self) -> int:
        """The optimizer's state back from host memory, the gradient buffers re-allocated (zeroed); the bytes
        moved or allocated."""
        moved = self._optimizer.onload()
        for storage, nbytes in self._gradients:
            storage.resize_(nbytes)
            storage.fill_(0)
            moved += nbytes
        self._gradients = []
        return moved

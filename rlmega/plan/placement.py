"""Which tensors a GPU run keeps on the GPU and which it keeps in host memory, told apart without a GPU.

Megatron's CPU-offloaded optimizer (``HybridDeviceOptimizer``) decides what to move by ``param.is_cuda``
and moves it with ``.cpu()`` / ``pin_memory``. Inside ``simulated_gpu()`` every tensor counts as a GPU
tensor except those a call put in host memory (``.cpu()``, ``device="cpu"``, ``pin_memory=True``, ``.to``
the CPU) and those computed from them alone; ``on_host`` says which. With ``meta=True`` every tensor also
lands on the meta device (the planner's build: real shapes and dtypes, no memory); without it the
tensors are real, so a CPU test can step the optimizer and see where each state went.

``allocated_bytes`` then sums what an object (the optimizer) holds, by place, each storage once.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_HOST = "_rlmega_on_host"


def on_host(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _HOST, False)


def _mark(value):
    if isinstance(value, torch.Tensor):
        setattr(value, _HOST, True)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark(item)
    return value


def _device_type(value) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return "cuda"  # an ordinal, as torch.cuda.current_device() returns
    if isinstance(value, (str, torch.device)):
        return torch.device(value).type
    return None


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)


class _HostTracking(TorchFunctionMode):
    def __init__(self, meta: bool):
        super().__init__()
        self.meta = meta

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device="meta") if self.meta else tensor.detach().clone()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cpu:
            return _mark(self._copy(args[0]))
        if func is torch.Tensor.cuda:
            return self._copy(args[0])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizer accepts torch.cuda.*Tensor parameters only.
            name = func(*args).replace("cuda.", "").replace("meta.", "")
            return name if on_host(args[0]) else name.replace("torch.", "torch.cuda.", 1)
        target = _device_type(kwargs.get("device"))
        if func is torch.Tensor.to:
            target = next((kind for kind in map(_device_type, args[1:]) if kind), target)
        if kwargs.pop("pin_memory", False):
            target = "cpu"
        # torch.tensor holds Python values (Adam's step count on the CPU): real, as the step reads them.
        if self.meta and kwargs.get("device") is not None and func is not torch.tensor:
            kwargs["device"] = "meta"
        if self.meta and func is torch.Tensor.to:
            args = tuple("meta" if _device_type(arg) else arg for arg in args)
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        result = func(*args, **kwargs)
        if target is not None and any(result is tensor for tensor in inputs):
            if on_host(result) == (target == "cpu"):
                return result  # already there: .to() returns the tensor itself
            result = self._copy(result)
        if target == "cpu" or (target is None and any(map(on_host, inputs))
                               and not any(result is tensor for tensor in inputs)):
            _mark(result)
        return result


@contextlib.contextmanager
def simulated_gpu(meta: bool = False):
    """Tensors count as GPU tensors (``is_cuda``) unless a call put them in host memory (``on_host``)."""
    torch.Tensor.is_cuda = property(lambda tensor: not on_host(tensor))
    try:
        with _HostTracking(meta):
            yield
    finally:
        del torch.Tensor.is_cuda  # torch's own property again


def _reachable_tensors(root, skip: tuple[type, ...]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and dict keys, once."""
    seen, stack = set(), [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, skip):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            stack += list(value.keys()) + list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += list(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack += list(vars(value).values())


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def allocated_bytes(root, exclude: set[int] = frozenset(),
                    is_host: Callable[[torch.Tensor], bool] = on_host) -> dict[str, int]:
    """{"gpu": bytes, "host": bytes} of the storages reachable from ``root`` (modules not followed),
    each counted once, leaving out the storages in ``exclude`` (``storage_key``: the model's own) and
    one-element tensors (step counts, flags and loss scales: bytes, where the state is gigabytes).
    ``is_host`` tells the places apart: ``simulated_gpu``'s by default, a real device's on a GPU."""
    totals, counted = {"gpu": 0, "host": 0}, set(exclude)
    for tensor in _reachable_tensors(root, (torch.nn.Module,)):
        if tensor.numel() <= 1:
            continue
        key = storage_key(tensor)
        if key not in counted:
            counted.add(key)
            totals["host" if is_host(tensor) else "gpu"] += tensor.untyped_storage().nbytes()
    return totals

"""Run real Megatron-Core on a CUDA-less machine (CPU tensors, gloo collectives).

Megatron-Core assumes CUDA in a few dozen places: tensors allocated with ``device="cuda"`` or
``torch.cuda.current_device()``, CUDA streams, the CUDA RNG, ``param.type()`` compared with
``'torch.cuda.FloatTensor'``. On a torch build without CUDA every one of those raises, so giving
them a CPU meaning changes nothing that worked before. This module is the only place in rlmega
that does so; each redirect below says why in one line.

``route_collectives`` (called by ``layout.initialize`` on CPU) sends the all-reduces and broadcasts of given
groups through shared memory where their ranks share a host, since gloo's loopback TCP costs 0.3-1 ms each.

``direct`` runs a training step's hot loop (forward, backward, optimizer step) without the torch-function mode,
with the few calls that name CUDA there patched for the block, once the step's first run has proved that enough.

``enable()`` is a no-op when CUDA is available: on GPU, Megatron runs untouched.
The redirects were checked against the megatron-core versions in ``CHECKED_MCORE_VERSIONS``;
any other version is refused rather than half-patched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from typing import Callable, Hashable, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from rlmega.parallel import mcore_without_te
from rlmega.parallel.host_collectives import Completed, HostCollectives
from rlmega.parallel.mcore_version import SUPPORTED, require_checked

logger = logging.getLogger(__name__)

# (major, minor) releases of megatron-core whose CUDA-only calls were audited for this module: each name patched
# below (the RNG tracker and its state functions, the dispatcher's maybe_move_tensor_to_cpu, WrappedTorchNorm,
# p2p's _p2p_ops/_batched_p2p_ops) has the same meaning in each; tests/test_megatron_parallel.py runs on 0.16 and 0.19.
CHECKED_MCORE_VERSIONS = SUPPORTED

_enabled = False


def cpu_platform_needed() -> bool:
    """True when Megatron must run on CPU: no usable CUDA device."""
    return not torch.cuda.is_available()


def is_enabled() -> bool:
    return _enabled


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA ordinal in torch
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):  # parsed here: torch.device() would pass through the mode when called outside it
        return device.partition(":")[0].strip() == "cuda"
    return False


# torch's own entry points, kept before ``direct`` patches the Tensor methods for a block (the mode compares with these).
_DEVICE, _TENSOR_TO, _TENSOR_CUDA, _TENSOR_TYPE = torch.device, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type
# The calls that can name a device (or report a type) without keyword arguments; every other call does it by
# keyword (factory functions take ``device`` and ``pin_memory`` only so).
_NAMING_DEVICES_POSITIONALLY = frozenset({_DEVICE, _TENSOR_CUDA, _TENSOR_TO, _TENSOR_TYPE})


def _cuda_device_made(args: tuple, kwargs: dict) -> bool:
    """Whether ``torch.device(*args, **kwargs)`` names CUDA (``torch.device(0)``, ``torch.device("cuda")``)."""
    return _is_cuda_device(args[0]) if args else kwargs.get("type") == "cuda"


def _cpu_args(args) -> tuple:
    """``Tensor.to``'s positional arguments (after the tensor) with a CUDA device made the CPU."""
    return tuple("cpu" if _is_cuda_device(arg) else arg for arg in args)


def _names_cuda(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call would need CUDA: a CUDA device or pinned memory asked for (``Tensor.type()`` aside)."""
    if _is_cuda_device(kwargs.get("device")) or kwargs.get("pin_memory"):
        return True
    if func is _DEVICE:
        return _cuda_device_made(args, kwargs)
    if func is _TENSOR_TO:
        return any(_is_cuda_device(arg) for arg in args[1:])
    return func is _TENSOR_CUDA


def _cpu_kwargs(kwargs: dict) -> dict:
    """``kwargs`` with a CUDA ``device`` made the CPU and ``pin_memory`` (which needs CUDA) off, in place."""
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _cuda_type_name(name: str) -> str:
    return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)


class CudaAsCpu(TorchFunctionMode):
    """Maps every CUDA device named in a torch call to the CPU.

    Covers ``torch.zeros(..., device="cuda")``, ``t.to(torch.cuda.current_device())``, ``t.cuda()``,
    ``torch.device(0)`` / ``torch.device("cuda")`` (they name the CPU),
    ``pin_memory=True`` (needs CUDA) and ``t.type()`` (Megatron's optimizer accepts only
    ``torch.cuda.*Tensor`` type names, so CPU tensors report their CUDA twin).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and func not in _NAMING_DEVICES_POSITIONALLY:  # most calls: nothing to map, nothing to copy
            return func(*args)
        kwargs = _cpu_kwargs(dict(kwargs or {}))
        if func is _DEVICE and _cuda_device_made(args, kwargs):
            return torch.device("cpu")  # e.g. YaRN RoPE's `with torch.device(torch.cuda.current_device())`
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TO:
            args = (args[0], *_cpu_args(args[1:]))
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            return _cuda_type_name(func(*args))
        return func(*args, **kwargs)


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is complete when the call returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: on CPU every op is already ordered and synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


_CPU_STREAM = _CpuStream()


def _patch_torch_cuda():
    # These torch.cuda entry points can only raise on a CUDA-less build; give them CPU meanings.
    torch.cuda.current_device = lambda: 0  # an index; CudaAsCpu maps CUDA ordinals to the CPU
    torch.cuda.Stream = _CpuStream  # MoE dispatcher and DDP create side streams
    torch.cuda.Event = _CpuEvent  # recorded on those streams and waited on
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM  # compared with side streams
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # `with torch.cuda.stream(s)`
    torch.cuda.synchronize = lambda device=None: None  # CPU ops finish before returning
    torch.Tensor.record_stream = lambda self, stream: None  # no caching allocator to inform


# What a custom autograd Function's backward runs under: the redirect, or nothing inside a proven ``direct`` block.
_backward_redirect: Optional[Callable[[], TorchFunctionMode]] = CudaAsCpu


def _patch_autograd_backward():
    # Autograd calls Python backward() without the caller's torch-function modes; re-enter ours
    # so Megatron's custom Functions can allocate "cuda" tensors in backward too.
    from torch.autograd.function import BackwardCFunction

    run_backward = BackwardCFunction.apply

    def apply_with_cpu_devices(self, *args):
        if _backward_redirect is None:
            return run_backward(self, *args)
        with _backward_redirect():
            return run_backward(self, *args)

    BackwardCFunction.apply = apply_with_cpu_devices


class CpuRNGStatesTracker:
    """Mixin body for Megatron's ``CudaRNGStatesTracker`` keeping named CPU generator states.

    On CPU the default generator plays the CUDA generator's role: ``fork(name)`` swaps the named
    state in, so dropout inside tensor-parallel regions draws from the per-rank stream exactly as
    on GPU.
    """

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added; call model_parallel_cuda_manual_seed")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _patch_rng_tracker():
    # The tracker reads and writes the CUDA RNG; keep its named states on CPU generators instead.
    from megatron.core.tensor_parallel import random as mcore_random

    base = mcore_random.CudaRNGStatesTracker
    cpu_tracker = type("CpuRNGStatesTracker", (CpuRNGStatesTracker, base), {})
    mcore_random.CudaRNGStatesTracker = cpu_tracker
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, base):
        mcore_random._CUDA_RNG_STATE_TRACKER.__class__ = cpu_tracker


def _patch_moe():
    from megatron.core.transformer.moe import token_dispatcher

    # The alltoall dispatcher turns split sizes into numpy only for CUDA tensors; do it on CPU too.
    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def _run_fusions_eagerly():
    # Megatron wraps its fused kernels (the expert-bias update of DeepSeek routing, bias-activation fusions) in
    # torch.compile. On CPU, inductor needs a C++ compiler, which slim images lack (InvalidCxxCompiler), and
    # compiles per shape for seconds (14 s of a 21 s DeepSeek MTP step here) to fuse kilobytes: run them as written.
    torch.compiler.set_stance("force_eager")


def _patch_torch_norm():
    # The torch norm refuses sequence parallel although per-token norms shard fine along the
    # sequence; allow it and mark the weights so their gradients are all-reduced over TP.
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new_norm(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new_norm


def _patch_pipeline_p2p():
    # gloo pairs a batch of sends and receives by posting order, so with two pipeline stages
    # (prev == next) an activation and a gradient swap places; post them in Megatron's even/odd order.
    from megatron.core.pipeline_parallel import p2p_communication

    def ordered_p2p_ops(**kwargs):
        return list(p2p_communication._p2p_ops(**kwargs).values())

    p2p_communication._batched_p2p_ops = ordered_p2p_ops


# ---- collectives of ranks on one host --------------------------------------------------

# Megatron's groups whose collectives go through shared memory (rlmega.parallel.host_collectives): the group
# -> its HostCollectives, or None where a rank could not map the region (that group stays on gloo).
_HOST_GROUPS: dict = {}
_gloo_all_reduce = dist.all_reduce
_gloo_broadcast = dist.broadcast
_COMPLETED = Completed()


def route_collectives(groups: list, timeout_s: float) -> int:
    """Collective over each of ``groups`` (in this order on every rank): their all-reduces and broadcasts go
    through shared memory where all of a group's ranks share this host's /dev/shm. Only groups that Megatron
    never batches in a ``_coalescing_manager`` may be given (it collects gloo calls and issues them at its end).
    The number of groups routed."""
    for group in groups:
        if group is not None and group not in _HOST_GROUPS and dist.get_world_size(group) > 1:
            _HOST_GROUPS[group] = HostCollectives.open(group, timeout_s)
    # torch.distributed's functions are looked up on the module at each call (Megatron, rlmega): replace those.
    dist.all_reduce, dist.broadcast = _all_reduce, _broadcast
    return sum(host is not None for host in _HOST_GROUPS.values())


def unroute_collectives() -> None:
    """Every group back on gloo (their process groups are being destroyed)."""
    _HOST_GROUPS.clear()
    dist.all_reduce, dist.broadcast = _gloo_all_reduce, _gloo_broadcast


def _host(group, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
    host = _HOST_GROUPS.get(dist.group.WORLD if group is None else group)
    return host if host is not None and host.takes(tensor, op) else None


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    host = _host(group, tensor, op)
    if host is None:
        return _gloo_all_reduce(tensor, op=op, group=group, async_op=async_op)
    host.all_reduce(tensor, op)
    return _COMPLETED if async_op else None


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    host = _host(group, tensor)
    if host is None:
        return _gloo_broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    host.broadcast(tensor, group_src if group_src is not None else dist.get_group_rank(host.group, src))
    return _COMPLETED if async_op else None


def check_mcore_version(version: str) -> None:
    """Refuse megatron-core releases whose CUDA-only calls were not audited."""
    require_checked(
        version, CHECKED_MCORE_VERSIONS,
        "rlmega's CPU platform was checked on megatron-core {checked}, not {version}; "
        "install a checked release (pip install '{install}') or run on a GPU.",
    )


def enable() -> bool:
    """Make Megatron-Core run on CPU in this process. Returns True when the redirects are active.

    Idempotent. Does nothing when CUDA is available. Must run in every process that calls into
    Megatron (the multi-rank harness and the workers call it at start-up).
    """
    global _enabled
    if _enabled:
        return True
    if not cpu_platform_needed():
        return False
    with warnings.catch_warnings():
        # Megatron says on import that TE and apex are missing: expected on CPU, `rlmega doctor` reports it.
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (is|are) not installed")
        import megatron.core
        import megatron.core.optimizer  # noqa: F401 - warns on first import too
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    check_mcore_version(megatron.core.__version__)
    _patch_torch_cuda()
    _patch_autograd_backward()
    _patch_rng_tracker()
    _patch_moe()
    _run_fusions_eagerly()
    _patch_torch_norm()
    _patch_pipeline_p2p()
    mcore_without_te.apply()
    _enabled = True
    if not isinstance(torch.overrides._get_current_function_mode(), CudaAsCpu):  # redirected() may hold one
        CudaAsCpu().__enter__()  # this thread's every later torch call; autograd's threads re-enter it (above)
    logger.debug("rlmega CPU platform enabled for megatron-core %s", megatron.core.__version__)
    return True


def _redirecting() -> bool:
    """Whether this thread's innermost torch-function mode is the redirect (modes are per thread)."""
    return isinstance(torch.overrides._get_current_function_mode(), CudaAsCpu)


@contextlib.contextmanager
def suspended():
    """Run code that never calls Megatron (a rollout engine in a training rank's process) without the
    redirect: every torch call passes through ``CudaAsCpu``'s Python first, which doubles the cost of a
    small op, and a generation makes thousands of them. Only this thread's redirect is taken off, and only
    while the block runs; nothing happens where it is not active."""
    if not _redirecting():
        yield
        return
    mode = torch.overrides._get_current_function_mode()
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


@contextlib.contextmanager
def redirected():
    """The redirect for the block only, on a thread that otherwise runs without it: the driver of a run in one
    process calls its Megatron rank this way, so that its own torch calls (advantages, batching, metrics) and
    its engine's never pay for it. ``enable`` inside the block (the rank's set-up) adds no second redirect, and
    the thread's modes are as they were afterwards. Nothing happens where the redirect is already active."""
    if _redirecting():
        yield
        return
    if _enabled:
        CudaAsCpu().__enter__()
    try:
        yield
    finally:
        if _redirecting():  # the one entered above, or the one enable() entered in the block
            torch.overrides._get_current_function_mode().__exit__(None, None, None)


# ---- a training step without the mode ---------------------------------------------------

# Where a step names CUDA by keyword (``device=``, ``pin_memory=``): torch's factory functions and the Tensor methods
# that make a new tensor. ``direct`` maps those calls by patching them for the block.
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
              "randperm", "linspace", "eye", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like",
              "rand_like", "randn_like", "randint_like")
_NEW_TENSOR_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
DIRECT_ENV = "RLMEGA_CPU_DIRECT"
"""``0`` keeps every step under the redirect's mode (``direct`` does nothing)."""

# owner (a model) -> {kind of block: True once its first run named CUDA only where the patches map it, else False}
_VERDICTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _with_cpu_kwargs(original: Callable) -> Callable:
    def call(*args, **kwargs):
        return original(*args, **_cpu_kwargs(kwargs)) if kwargs else original(*args)
    return call


def _to_cpu(self, *args, **kwargs):
    return _TENSOR_TO(self, *_cpu_args(args), **_cpu_kwargs(kwargs))


def _cuda_type(self, *args, **kwargs):
    name = _TENSOR_TYPE(self, *args, **kwargs)
    return name if args or kwargs else _cuda_type_name(name)


_PATCHES: list[tuple[object, str, Callable, Callable]] = []
"""(owner, attribute, torch's own, replacement) of every call ``direct`` maps itself; made at its first use."""


def _direct_patches() -> list[tuple[object, str, Callable, Callable]]:
    if not _PATCHES:
        # torch's default-device context (``with torch.device(...)``) finds the factory functions in a set it makes
        # once, at first use: made inside a block, it would hold the replacements and miss torch's own ever after.
        import torch.utils._device

        torch.utils._device._device_constructors()
        named = [(torch, name) for name in _FACTORIES] + [(torch.Tensor, name) for name in _NEW_TENSOR_METHODS]
        _PATCHES.extend((owner, name, getattr(owner, name), _with_cpu_kwargs(getattr(owner, name)))
                        for owner, name in named)
        _PATCHES.extend([(torch.Tensor, "to", _TENSOR_TO, _to_cpu),
                         (torch.Tensor, "cuda", _TENSOR_CUDA, lambda self, *args, **kwargs: self),
                         (torch.Tensor, "type", _TENSOR_TYPE, _cuda_type)])
    return _PATCHES


class _Watching(CudaAsCpu):
    """The redirect, noting every call that reaches it still naming CUDA: a call the patches of ``direct`` miss."""

    def __init__(self, missed: list[str]):
        super().__init__()
        self.missed = missed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (kwargs or func in _NAMING_DEVICES_POSITIONALLY) and _names_cuda(func, args, kwargs or {}):
            self.missed.append(getattr(func, "__qualname__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs)


class MissedCudaCall(RuntimeError):
    """A ``direct`` block named CUDA in a call only the redirect's mode maps, on a path its first run did not take."""


@contextlib.contextmanager
def direct(owner: object, kind: Hashable):
    """A block that makes the same torch calls every time it runs (a training step's forward and backward, an
    optimizer step), without the redirect's torch-function mode: the mode puts a Python call in front of every
    torch op, 3-8 % of a small model's update on CPU. The block's calls that name CUDA are the factory
    functions' and a few Tensor methods' (``device=``, ``pin_memory=``, ``.to``, ``.cuda``, ``.type()``); they are
    patched for the block instead.

    The first run of each ``kind`` for ``owner`` runs under the mode and notes any call that still reaches it naming
    CUDA; if none did, the later runs go without the mode, else all of them keep it. A later run that takes a path
    the first did not and names CUDA there fails with ``MissedCudaCall`` (``RLMEGA_CPU_DIRECT=0`` keeps the mode
    everywhere). Nothing happens where the redirect is not active on this thread (on GPU, on a driver's thread)."""
    if not _redirecting() or os.environ.get(DIRECT_ENV, "1") == "0":
        yield
        return
    verdicts = _VERDICTS.setdefault(owner, {})
    verdict = verdicts.get(kind)
    if verdict is False:
        yield
        return
    global _backward_redirect
    missed: list[str] = []
    mode = torch.overrides._get_current_function_mode()
    mode.__exit__(None, None, None)
    watching = None if verdict else _Watching(missed)
    if watching is not None:
        watching.__enter__()
    for patched, name, _, replacement in _direct_patches():
        setattr(patched, name, replacement)
    _backward_redirect = None if watching is None else (lambda: _Watching(missed))
    try:
        yield
    except (AssertionError, RuntimeError) as error:
        # Where the redirect is active, CUDA is unusable: a CPU build says "not compiled with CUDA", a CUDA build
        # without a GPU "no NVIDIA driver" or, in a forked rank, "Cannot re-initialize CUDA".
        if verdict and any(word in str(error).lower() for word in ("cuda", "nvidia")):
            raise MissedCudaCall(
                f"a step on rlmega's CPU platform named a CUDA device in a call it maps only under its torch-function "
                f"mode, on a path the step's first run did not take ({error}); set {DIRECT_ENV}=0 to keep every step "
                f"under the mode") from error
        raise
    else:
        if watching is not None:
            verdicts[kind] = not missed
            if missed:
                logger.debug("CPU platform: %r keeps the mode; its calls %s name CUDA", kind, sorted(set(missed)))
    finally:
        _backward_redirect = CudaAsCpu
        for patched, name, original, _ in _PATCHES:
            setattr(patched, name, original)
        if watching is not None:
            watching.__exit__(None, None, None)
        mode.__enter__()

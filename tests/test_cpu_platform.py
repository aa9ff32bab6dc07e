"""The CPU platform: each redirect of Megatron's CUDA-only calls does what its comment says.

Tests that need the process-wide redirects run in a spawned rank, so this pytest process keeps
plain torch.
"""

import pytest
import torch
import torch.distributed as dist

from rlmega.parallel import cpu_platform
from rlmega.parallel.cpu_platform import CudaAsCpu, check_mcore_version
from rlmega.parallel.spawn import run_on_ranks


def test_cuda_devices_become_cpu_inside_the_mode():
    with CudaAsCpu():
        made = [
            torch.zeros(2, device="cuda"),
            torch.ones(2, device=torch.device("cuda", 0)),
            torch.empty(2, device=0),
            torch.tensor([1.0], device="cuda:0"),
            torch.arange(3).to("cuda"),
            torch.arange(3).to(device=0),
            torch.arange(3).cuda(),
            torch.zeros(2, pin_memory=True),
        ]
        type_name = torch.zeros(1).type()
        half_name = torch.zeros(1, dtype=torch.bfloat16).type()
    assert all(t.device.type == "cpu" for t in made)
    assert type_name == "torch.cuda.FloatTensor"  # what Megatron's optimizer checks for
    assert half_name == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # nothing leaks outside the mode
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_only_audited_megatron_versions_are_accepted():
    for version in ("0.16.1", "0.16.0rc0", "0.17.1", "0.18.2", "0.19.2"):
        check_mcore_version(version)
    for version in ("0.15.3", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"checked on megatron-core 0\.16\.x through 0\.19\.x, not {version}; "
                                               r"install a checked release \(pip install 'megatron-core>=0\.16,<0\.20'\)"):
            check_mcore_version(version)


def test_enable_does_nothing_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert cpu_platform.enable() is False
    assert not cpu_platform.is_enabled()
    assert torch.cuda.current_device is current_device


@pytest.mark.gpu
def test_gpu_megatron_runs_untouched():
    """On a GPU machine enable() is a no-op and Megatron allocates on the real device."""
    assert cpu_platform.enable() is False
    assert torch.zeros(1, device="cuda").is_cuda


class _DoubleWithCudaBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full((1,), 2.0, device="cuda")  # as Megatron's custom Functions do


def _backward_allocates_on_cuda(rank, world_size):
    x = torch.ones(3, requires_grad=True)
    _DoubleWithCudaBackward.apply(x).sum().backward()
    return x.grad.tolist()


def test_custom_backward_sees_the_redirect():
    # Autograd runs backward() without the caller's modes; the platform re-enters them there.
    assert run_on_ranks(_backward_allocates_on_cuda, 1, timeout_s=60) == [[2.0, 2.0, 2.0]]


def _cuda_stand_ins(rank, world_size):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    event = stream.record_event()
    event.synchronize()
    torch.cuda.synchronize()
    torch.zeros(1).record_stream(stream)
    return torch.cuda.current_device(), torch.cuda.current_stream() == stream


def test_cuda_runtime_calls_have_cpu_meanings():
    assert run_on_ranks(_cuda_stand_ins, 1, timeout_s=60) == [(0, True)]


def _compiled_function_runs(rank, world_size):
    from megatron.core.jit import jit_fuser

    compiled = []

    def recording_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    scale = torch.compile(lambda x: x * 2 + 1, backend=recording_backend)
    fused = jit_fuser(lambda x: torch.sigmoid(x) * x)  # how Megatron wraps its fusions (torch.compile)
    x = torch.arange(4.0)
    return torch.equal(scale(x), x * 2 + 1), torch.equal(fused(x), torch.sigmoid(x) * x), len(compiled)


def test_compiled_functions_run_eagerly_needing_no_cpp_compiler():
    assert run_on_ranks(_compiled_function_runs, 1, timeout_s=120) == [(True, True, 0)]


def _rng_tracker_streams(rank, world_size):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from rlmega.parallel.layout import ParallelLayout, initialize

    initialize(ParallelLayout())
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(123)
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
    with tracker.fork():
        second = torch.rand(4)
    expected = torch.rand(8, generator=torch.Generator().manual_seed(123 + 2718))  # tp rank 0 seed
    return torch.equal(torch.cat([first, second]), expected), type(tracker).__name__


def test_rng_tracker_forks_named_cpu_streams():
    assert run_on_ranks(_rng_tracker_streams, 1, timeout_s=60) == [(True, "CpuRNGStatesTracker")]


def _norm_with_sequence_parallel(rank, world_size):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
        tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True,
    )
    norm = WrappedTorchNorm(config, 8)
    return type(norm).__name__, [getattr(p, "sequence_parallel", False) for p in norm.parameters()], config.sequence_parallel


def test_torch_norm_accepts_sequence_parallel_and_marks_its_weights():
    assert run_on_ranks(_norm_with_sequence_parallel, 1, timeout_s=60) == [("RMSNorm", [True], True)]


def _exchange_both_directions(rank, world_size):
    from megatron.core.pipeline_parallel import p2p_communication

    peer = 1 - rank
    activation, gradient = torch.full((2,), 10.0 + rank), torch.full((2,), 20.0 + rank)
    received_activation, received_gradient = torch.empty(2), torch.empty(2)
    # Interleaved 1F1B with two stages: each rank sends an activation forward and a gradient back,
    # and both go to the same peer, which is where gloo's batched pairing swaps them.
    requests = p2p_communication._batched_p2p_ops(
        tensor_send_prev=gradient,
        tensor_recv_prev=received_activation,
        tensor_send_next=activation,
        tensor_recv_next=received_gradient,
        group=dist.group.WORLD,
        prev_pipeline_rank=peer,
        next_pipeline_rank=peer,
    )
    for request in requests:
        request.wait()
    return received_activation.tolist(), received_gradient.tolist()


def test_two_stage_pipeline_exchange_keeps_tensors_apart():
    rank0, rank1 = run_on_ranks(_exchange_both_directions, 2, timeout_s=60)
    assert rank0 == ([11.0, 11.0], [21.0, 21.0])  # rank 1's activation and gradient, in place
    assert rank1 == ([10.0, 10.0], [20.0, 20.0])


def _cuda_zeros_device() -> str:
    """Where ``torch.zeros(1, device="cuda")`` lands on this thread: "cpu" under the redirect, else the error's name."""
    try:
        return torch.zeros(1, device="cuda").device.type
    except (AssertionError, RuntimeError) as error:
        return type(error).__name__


def _suspended_and_redirected(rank, world_size):
    import threading

    seen = {"enabled": _cuda_zeros_device()}  # the ranks run with the platform enabled
    with cpu_platform.suspended():
        seen["suspended"] = _cuda_zeros_device()
        with cpu_platform.redirected():
            seen["redirected inside suspended"] = _cuda_zeros_device()
        seen["suspended after"] = _cuda_zeros_device()
        with cpu_platform.suspended():  # nothing to take off
            seen["suspended twice"] = _cuda_zeros_device()
    seen["after"] = _cuda_zeros_device()
    with cpu_platform.redirected():  # already redirected: nothing changes, also after
        seen["redirected twice"] = _cuda_zeros_device()
    seen["after redirected"] = _cuda_zeros_device()
    other: dict = {}  # modes are per thread: a new thread starts without the redirect
    thread = threading.Thread(target=lambda: other.update(plain=_cuda_zeros_device()))
    thread.start()
    thread.join()
    seen["other thread"] = other["plain"]
    return seen


def test_suspended_and_redirected_change_this_thread_for_the_block_only():
    seen = run_on_ranks(_suspended_and_redirected, 1, timeout_s=60)[0]
    off = seen["suspended"]
    assert off != "cpu"  # the real torch: no CUDA here
    assert seen == {"enabled": "cpu", "suspended": off, "redirected inside suspended": "cpu", "suspended after": off,
                    "suspended twice": off, "after": "cpu", "redirected twice": "cpu", "after redirected": "cpu",
                    "other thread": off}


_FIRST_ENABLE_INSIDE_REDIRECTED = """
import torch
from rlmega.parallel import cpu_platform

def device():
    try:
        return torch.zeros(1, device="cuda").device.type
    except (AssertionError, RuntimeError) as error:
        return type(error).__name__

before = device()
with cpu_platform.redirected():  # not enabled yet: enters nothing; enable() then enters the redirect
    cpu_platform.enable()
    inside, depth = device(), torch.overrides._len_torch_function_stack()
print(before, inside, depth, device(), torch.overrides._len_torch_function_stack())
"""


def test_redirected_holds_what_enable_enters_in_the_block_only():
    # A run in one process sets its rank up inside redirected(): the first enable() there must not leave a
    # redirect behind on the driver's thread (its own torch calls, and its engine's, would pay for it on every op).
    import subprocess
    import sys

    printed = subprocess.run([sys.executable, "-c", _FIRST_ENABLE_INSIDE_REDIRECTED], capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
    before, inside, depth, after, depth_after = printed
    assert (inside, depth) == ("cpu", "1")
    assert after == before != "cpu" and depth_after == "0"


class _Owner:
    """Stands in for a model: ``direct`` keeps its verdicts per owner (weakly)."""


def _direct_runs(rank, world_size):
    import os

    torch_zeros = torch.zeros
    owner, depths, devices = _Owner(), {}, {}

    def covered():  # every CUDA-naming call the patches map
        made = [torch.zeros(2, device="cuda"), torch.empty(2, device=0), torch.tensor([1.0], device="cuda:0"),
                torch.arange(3).to("cuda"), torch.arange(3).to(device=0), torch.arange(3).cuda(),
                torch.ones(2).new_zeros(3, device="cuda"), torch.zeros(2, pin_memory=True)]
        return {t.device.type for t in made} | {torch.zeros(1).type()}

    for run in range(2):
        with cpu_platform.direct(owner, "covered"):
            depths[f"covered {run}"] = torch.overrides._len_torch_function_stack()
            devices[f"covered {run}"] = covered()
    for run in range(2):  # torch.device("cuda") reaches the mode: this kind keeps it
        with cpu_platform.direct(owner, "device object"):
            depths[f"device object {run}"] = torch.overrides._len_torch_function_stack()
            devices[f"device object {run}"] = {torch.device("cuda").type} | covered()
    with torch.device("meta"):  # torch's default-device context still knows its own factory functions
        on_meta = torch.zeros(1).device.type
    after = (torch.overrides._len_torch_function_stack(), torch.zeros is torch_zeros, _cuda_zeros_device(),
             cpu_platform._backward_redirect is CudaAsCpu, on_meta)

    class AllocatesInBackward(torch.autograd.Function):  # Megatron's custom Functions do this
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.full_like(grad, 2.0, device="cuda")

    grads = []
    for run in range(2):
        with cpu_platform.direct(owner, "backward"):
            x = torch.ones(3, requires_grad=True)
            AllocatesInBackward.apply(x).sum().backward()
            grads.append(x.grad.tolist())

    missed = None
    try:  # proven on a run that did not take the path below
        with cpu_platform.direct(owner, "covered"):
            with torch.device("cuda"):  # a default device the patches cannot see
                torch.zeros(1)
    except cpu_platform.MissedCudaCall as error:
        missed = str(error)
    builds = []  # what a CUDA build of torch says instead of "not compiled with CUDA" where it finds no GPU
    for message in ("Found no NVIDIA driver on your system.", "Cannot re-initialize CUDA in forked subprocess.",
                    "an error about something else"):
        try:
            with cpu_platform.direct(owner, "covered"):
                raise RuntimeError(message)
        except RuntimeError as error:
            builds.append(type(error).__name__)
    os.environ[cpu_platform.DIRECT_ENV] = "0"
    with cpu_platform.direct(owner, "covered"):
        depths["switched off"] = torch.overrides._len_torch_function_stack()
    return dict(depths=depths, devices=devices, verdicts=dict(cpu_platform._VERDICTS[owner]), after=after,
                grads=grads, missed=missed, builds=builds, depth_at_end=torch.overrides._len_torch_function_stack())


def test_direct_runs_without_the_mode_once_its_first_run_proved_the_patches_cover_it():
    seen = run_on_ranks(_direct_runs, 1, timeout_s=60)[0]
    cuda_twin = "torch.cuda.FloatTensor"
    assert seen["devices"] == {"covered 0": {"cpu", cuda_twin}, "covered 1": {"cpu", cuda_twin},
                               "device object 0": {"cpu", cuda_twin}, "device object 1": {"cpu", cuda_twin}}
    # The first run watches under the mode; a proven kind then runs with no mode at all, a refused one keeps it.
    assert seen["depths"] == {"covered 0": 1, "covered 1": 0, "device object 0": 1, "device object 1": 1,
                              "switched off": 1}
    assert seen["verdicts"] == {"covered": True, "device object": False, "backward": True}
    assert seen["after"] == (1, True, "cpu", True, "meta")  # the mode and torch's own functions are back afterwards
    assert seen["grads"] == [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]  # d(sum(2x))/dx, the backward's "cuda" tensor on CPU
    assert "RLMEGA_CPU_DIRECT=0" in seen["missed"] and "path the step's first run did not take" in seen["missed"]
    assert seen["builds"] == ["MissedCudaCall", "MissedCudaCall", "RuntimeError"]
    assert seen["depth_at_end"] == 1

"""With ``rollout.weight_dtype=fp8`` the weight sync quantizes the bridge's buckets at trainer rank 0: the engine
receives each linear weight as FP8 with its scales (half the bytes of bf16, a quarter of fp32), bit-identical to the
reference blockwise quantization of the trainer's weight, and the rest as it is."""

import torch

from rlmega.bridge import load_hf_weights
from rlmega.bridge.fp8 import is_quantized, quantize_blockwise, scale_name
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.sync.registry import make_transport
from rlmega.sync.weight_sync import GatheredTransport


class CollectingEngine:
    """Keeps what an update brings, as it arrives."""

    def __init__(self):
        self.received: dict = {}

    def update_weights(self, named_tensors, version: int) -> None:
        self.received.update((name, tensor.clone()) for name, tensor in named_tensors)


def _push(rank, world_size, directory):
    layout = ParallelLayout(tp=2, world_size=2)
    initialize(layout)
    spec = model_spec_from_hf(directory)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, directory)
    engines = [CollectingEngine()] if rank == 0 else None
    buckets = make_transport("in_process", engines, bucket_bytes=1 << 20) if engines else None
    stats = GatheredTransport(chunks, spec, engines, buckets, bucket_bytes=1 << 20, weight_dtype="fp8").push(1)
    destroy()
    if engines is None:
        return None
    fp8 = {name for name, tensor in engines[0].received.items() if tensor.dtype == torch.float8_e4m3fn}
    # FP8 tensors cross back to the test as their bytes (this torch does not unpickle them).
    return {name: t.view(torch.uint8) if name in fp8 else t for name, t in engines[0].received.items()}, fp8, stats.bytes


def test_the_sync_sends_linear_weights_as_fp8(start_dir):
    from safetensors.torch import load_file

    received, fp8, nbytes = run_on_ranks(_push, 2, timeout_s=120, args=(str(start_dir),))[0]
    saved = load_file(next(start_dir.glob("*.safetensors")))
    assert nbytes == sum(t.numel() * t.element_size() for t in received.values())
    quantized = [name for name, tensor in saved.items() if is_quantized(name, tensor.shape)]
    assert quantized and set(received) == set(saved) | {scale_name(name) for name in quantized}
    assert nbytes < sum(t.numel() * t.element_size() for t in saved.values()) / 2  # fp32 weights: about a quarter
    for name, tensor in saved.items():
        if name in quantized:
            weight, scale = quantize_blockwise(tensor)
            assert name in fp8 and torch.equal(received[name], weight.view(torch.uint8)), name
            assert torch.equal(received[scale_name(name)], scale), name
        else:
            assert torch.equal(received[name], tensor), name

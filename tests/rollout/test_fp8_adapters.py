"""The vLLM and SGLang adapters with ``weight_dtype="fp8"``, against the fakes bound to the wheels' FP8 loaders
(tests/rollout/fakes/tiny_backend.py): started from an FP8 checkpoint, updates arriving as FP8 pairs or in full
precision leave the engine serving the reference quantization of the new weights."""

import json
import subprocess
import sys

import pytest
import torch

from rlmega.bridge.fp8 import FP8_DTYPE, quantized_buckets, quantized_stream
from rlmega.rollout import HFEngine, UnknownWeightError

from .fakes import contract, fake_sglang, fake_vllm, one_thread
from .tiny_models import checkpoint_tensors


@pytest.fixture(params=["vllm", "sglang"])
def make_engine(request, monkeypatch):
    fake = {"vllm": fake_vllm, "sglang": fake_sglang}[request.param]
    monkeypatch.setitem(sys.modules, request.param, fake)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        if request.param == "vllm":
            from rlmega.rollout.vllm_engine import VLLMEngine

            yield lambda path, **kwargs: VLLMEngine(path, gpu_memory_utilization=0.5, **kwargs)
        else:
            from rlmega.rollout.sglang_engine import SGLangEngine

            yield lambda path, **kwargs: SGLangEngine(path, mem_fraction_static=0.5, **kwargs)


def _served_model(engine):
    return (engine.llm if hasattr(engine, "llm") else engine.engine).model.model


def _assert_serves(engine, expected: HFEngine):
    served = _served_model(engine).state_dict()
    for name, tensor in expected.model.state_dict().items():
        assert torch.equal(served[name], tensor), name


def _sent_names(engine) -> list[str]:
    calls = engine.llm.calls if hasattr(engine, "llm") else engine.engine.calls
    names = []
    for call in calls:
        if call[0] == "collective_rpc":
            names += [name for name, _ in call[2][0]]
        elif call[0] == "update_weights_from_tensor":
            names += call[1]
    return names


def test_fp8_engine_starts_from_an_fp8_copy_and_quantizes_updates(make_engine, llama_dir, llama_other_dir):
    engine = make_engine(llama_dir, weight_dtype="fp8")
    assert engine.model_path != llama_dir
    config = json.loads((engine.model_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in engine.weights.shapes
    _assert_serves(engine, HFEngine(llama_dir, weight_dtype="fp8"))

    engine.update_weights(iter(sorted(checkpoint_tensors(llama_other_dir).items())), version=1)
    sent = _sent_names(engine)
    assert "model.layers.1.self_attn.q_proj.weight_scale_inv" in sent and "model.norm.weight" in sent
    expected = HFEngine(llama_other_dir, weight_dtype="fp8")
    _assert_serves(engine, expected)

    engine.update_weights(quantized_stream(sorted(checkpoint_tensors(llama_dir).items())), version=2)
    _assert_serves(engine, HFEngine(llama_dir, weight_dtype="fp8"))
    assert engine.weight_version() == 2


def test_the_fake_loader_takes_a_wide_tensor_unscaled_as_the_wheels_do(make_engine, llama_dir):
    """Why the adapter quantizes: the engine's FP8 parameter takes a bf16 tensor's values cast as they are."""
    engine = make_engine(llama_dir, weight_dtype="fp8")
    name = "model.layers.0.mlp.down_proj.weight"
    wide = checkpoint_tensors(llama_dir)[name]
    model = (engine.llm if hasattr(engine, "llm") else engine.engine).model
    model.load_weights([(name, wide)])
    scales = model.fp8_parts[name][1]
    assert model.fp8_parts[name][0].dtype == FP8_DTYPE
    assert not torch.allclose(_served_model(engine).state_dict()[name], wide, atol=scales.max().item() * 16)


def test_a_plain_engine_refuses_fp8_scales(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    with pytest.raises(UnknownWeightError, match="'model.layers.0.mlp.down_proj.weight_scale_inv'"):
        engine.update_weights(quantized_stream([("model.layers.0.mlp.down_proj.weight", torch.randn(64, 96))]),
                              version=1)
    assert _sent_names(engine) == []


def test_a_broadcast_of_unquantized_weights_into_an_fp8_engine_is_refused(make_engine, llama_dir):
    engine = make_engine(llama_dir, weight_dtype="fp8")
    engine._group_joined = True  # the refusal comes before anything is received
    engine.begin_update(1)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' arrives as bfloat16, but this "
                                          r"engine serves it in FP8"):
        engine.receive_weights([("model.layers.0.mlp.down_proj.weight", "bfloat16", (64, 96))])


FP8_SENDER = """
import os
import sys
import torch
from safetensors.torch import load_file
from rlmega.bridge.fp8 import quantized_buckets
from rlmega.rollout.weight_group import init_weight_update_group, broadcast_weights
port, path = int(sys.argv[1]), sys.argv[2]
tensors = sorted(load_file(path).items())
group = init_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name=f"rlmega_fp8_{port}",
                                 backend="gloo")
for bucket in quantized_buckets([tensors[:len(tensors) // 2], tensors[len(tensors) // 2:]]):
    broadcast_weights(group, bucket)
torch.distributed.destroy_process_group(group)
os._exit(0)  # rank 0 hosts the rendezvous store; interpreter teardown aborts while the engine is still connected
"""


def test_a_broadcast_of_fp8_buckets_is_served_exactly(make_engine, llama_dir, llama_other_dir):
    """FP8 buckets over a gloo group (which has no FP8 type: they travel as their bytes) into an FP8 engine."""
    from rlmega.rollout.weight_group import weight_meta

    engine = make_engine(llama_dir, weight_dtype="fp8")
    port = contract.free_port()
    (file,) = sorted(llama_other_dir.glob("*.safetensors"))
    sender = subprocess.Popen([sys.executable, "-c", FP8_SENDER, str(port), str(file)], stderr=subprocess.PIPE,
                              text=True)
    try:
        engine.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo",
                                        group_name=f"rlmega_fp8_{port}")
        engine.begin_update(1)
        tensors = sorted(checkpoint_tensors(llama_other_dir).items())
        for bucket in quantized_buckets([tensors[:len(tensors) // 2], tensors[len(tensors) // 2:]]):
            engine.receive_weights(weight_meta(bucket))
        engine.commit_update()
        _, errors = sender.communicate(timeout=60)
        assert sender.returncode == 0, errors
        engine.destroy_weight_update_group()
    finally:
        sender.kill()
    _assert_serves(engine, HFEngine(llama_other_dir, weight_dtype="fp8"))

"""The hf engine serving blockwise FP8: FP8 updates dequantized on load, full-precision ones rounded through FP8."""

import shutil

import pytest
import torch
from safetensors.torch import save_file

from rlmega.bridge.fp8 import FP8_DTYPE, dequantize_blockwise, is_quantized, quantize_blockwise, quantized_stream
from rlmega.rollout import HFEngine, SamplingParams

from .tiny_models import PROMPTS, checkpoint_tensors, load_reference, teacher_forced_logprobs


def _served(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an FP8 engine serves: each quantized weight dequantized from the reference quantization."""
    return {name: dequantize_blockwise(*quantize_blockwise(t)) if is_quantized(name, t.shape) else t
            for name, t in tensors.items()}


def _checkpoint_of(served: dict[str, torch.Tensor], like, directory):
    """A copy of checkpoint ``like`` holding ``served``, loaded by transformers itself."""
    shutil.copy(like / "config.json", directory / "config.json")
    save_file({name: t.contiguous() for name, t in served.items()}, directory / "model.safetensors")
    return load_reference(directory)


def test_fp8_update_is_dequantized_exactly(qwen3_moe_dirs, tmp_path):
    start, other = qwen3_moe_dirs
    engine = HFEngine(start)
    tensors = checkpoint_tensors(other)
    wire = list(quantized_stream(sorted(tensors.items())))
    assert any(t.dtype == FP8_DTYPE for _, t in wire) and any(n.endswith("_scale_inv") for n, _ in wire)
    engine.update_weights(iter(wire), version=1)
    reference = _checkpoint_of(_served(tensors), other, tmp_path)
    for name, tensor in reference.state_dict().items():  # fused experts included
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    assert engine.weight_version() == 1


def test_fp8_engine_rounds_full_precision_weights_the_same_way(llama_dir, llama_other_dir):
    fp8_engine = HFEngine(llama_other_dir, weight_dtype="fp8")  # checkpoint weights rounded at start
    updated = HFEngine(llama_dir, weight_dtype="fp8")
    updated.update_weights(iter(sorted(checkpoint_tensors(llama_other_dir).items())), version=1)
    quantized_update = HFEngine(llama_dir)
    quantized_update.update_weights(quantized_stream(sorted(checkpoint_tensors(llama_other_dir).items())), version=1)
    expected = quantized_update.model.state_dict()
    for engine in (fp8_engine, updated):
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    plain = HFEngine(llama_other_dir).model.state_dict()
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(plain[down], expected[down])
    assert torch.equal(plain["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


def test_fp8_engine_log_probs_differ_from_the_trainer_a_little(llama_dir):
    """The train-inference mismatch FP8 adds: visible, and far below a wrong weight's."""
    reference = load_reference(llama_dir)
    engine = HFEngine(llama_dir, weight_dtype="fp8")
    generations = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    differences = torch.cat([
        (torch.tensor(g.logprobs)
         - teacher_forced_logprobs(reference, PROMPTS[g.prompt_index], g.response_token_ids)).abs()
        for g in generations])
    assert 1e-4 < differences.mean() < 0.1


def test_fp8_weight_without_its_scales_is_refused(llama_dir):
    engine = HFEngine(llama_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    quantized, scales = quantize_blockwise(torch.randn(64, 96))
    before = engine.model.state_dict()[name].clone()
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' arrived without its scales: "
                                         r"'model.layers.0.mlp.down_proj.weight_scale_inv' must come right after it"):
        engine.update_weights(iter([(name, quantized), ("model.norm.weight", torch.ones(64))]), version=1)
    assert torch.equal(engine.model.state_dict()[name], before)
    with pytest.raises(ValueError, match="arrived without its scales .* \\(the stream ended\\)"):
        engine.update_weights(iter([(name, quantized)]), version=1)
    with pytest.raises(ValueError, match="FP8 scales 'x.weight_scale_inv' arrived without their weight"):
        engine.update_weights(iter([("x.weight_scale_inv", scales)]), version=1)
    with pytest.raises(ValueError, match=r"do not fit a weight of shape \(64, 96\)"):
        engine.update_weights(iter([(name, quantized), (name + "_scale_inv", torch.ones(3, 3))]), version=1)


def test_unknown_weight_dtype_is_refused(llama_dir):
    with pytest.raises(ValueError, match="weight_dtype must be one of auto, fp8, got 'fp4'"):
        HFEngine(llama_dir, weight_dtype="fp4")

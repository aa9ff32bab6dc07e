"""Blockwise FP8: bit-identical to a block-by-block reference, bounded round trip, the per-name rule."""

import math

import pytest
import torch

from rlmega.bridge.fp8 import (FP8_DTYPE, dequantize_blockwise, fp8_nbytes, is_quantized, kept_linear_modules,
                               quantization_config, quantize_blockwise, quantized_buckets, scale_name)


def reference_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's recipe written out one 128 x 128 block at a time (edge blocks as they are)."""
    rows, cols = weight.shape
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scales = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale = block.abs().float().max().clamp(min=1e-4) / 448.0
            scales[i, j] = scale
            quantized[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block.float() * (1.0 / scale)).to(FP8_DTYPE)
    return quantized, scales


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (7, 1000), (128, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_reference_bit_for_bit(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator) * 3).to(dtype)
    weight[:5, :5] = 0  # a zero corner: its block's scale is the clamp, not 0
    quantized, scales = quantize_blockwise(weight)
    expected_q, expected_s = reference_quantize(weight)
    assert quantized.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert scales.shape == expected_s.shape
    assert torch.equal(quantized.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scales, expected_s)


def test_round_trip_error_is_bounded_by_e4m3_precision():
    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    weight[:128, :128] *= 1000  # blocks of very different magnitudes keep their own scales
    restored = dequantize_blockwise(*quantize_blockwise(weight))
    _, scales = quantize_blockwise(weight)
    block_amax = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260] * 448
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, and subnormals are 2^-9 apart
    bound = torch.maximum(weight.abs() * 2 ** -4, block_amax / 448 * 2 ** -10)
    assert ((restored - weight).abs() <= bound + 1e-12).all()
    assert (restored - weight).abs().max() > 0


def test_dequantize_refuses_scales_that_do_not_fit():
    quantized, scales = quantize_blockwise(torch.randn(200, 200))
    with pytest.raises(ValueError, match=r"do not fit a weight of shape \(200, 200\); expected \(2, 2\)"):
        dequantize_blockwise(quantized, scales[:1])


def test_which_weights_are_quantized():
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.shared_experts.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight",
            "visual.blocks.0.attn.qkv.weight"]
    for name in quantized:
        assert is_quantized(name, (256, 256)), name
    for name in kept:
        assert not is_quantized(name, (256, 256)), name
    assert not is_quantized("model.layers.0.input_layernorm.weight", (256,))
    assert not is_quantized("model.layers.0.self_attn.q_proj.bias", (256,))
    names = [(name, (256, 256)) for name in quantized + kept] + [("model.norm.weight", (256,))]
    assert "model.layers.0.mlp.gate" in kept_linear_modules(names)
    assert "lm_head" in kept_linear_modules(names)
    assert "model.embed_tokens" not in kept_linear_modules(names)
    assert quantization_config(["lm_head"]) == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"]}


def test_quantized_buckets_pair_each_weight_with_its_scales():
    bucket = [("model.layers.0.self_attn.o_proj.weight", torch.randn(130, 64, dtype=torch.bfloat16)),
              ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16)),
              ("lm_head.weight", torch.randn(10, 64, dtype=torch.bfloat16))]
    (out,) = list(quantized_buckets([bucket]))
    assert [name for name, _ in out] == ["model.layers.0.self_attn.o_proj.weight",
                                          scale_name("model.layers.0.self_attn.o_proj.weight"),
                                          "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    assert out[0][1].dtype == FP8_DTYPE and tuple(out[1][1].shape) == (2, 1)
    assert out[2][1] is bucket[1][1] and out[3][1] is bucket[2][1]
    assert out[0][1].nbytes + out[1][1].nbytes == fp8_nbytes((130, 64))
    assert fp8_nbytes((4096, 4096)) < 4096 * 4096 * 2 * 0.51  # about half of bf16

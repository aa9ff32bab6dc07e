"""Blockwise FP8 weights in DeepSeek-V3's published format, which vLLM and SGLang load.

A quantized linear weight ``W`` [M, N] travels as two tensors: ``name`` (``torch.float8_e4m3fn`` [M, N]) and
``name_scale_inv`` (``<module>.weight_scale_inv``, fp32 [ceil(M/128), ceil(N/128)]), one scale per 128 x 128
block, with ``W ~= fp8 * scale_inv`` block by block. The scale is the block's largest magnitude over 448 (the
largest e4m3 value), so every block uses the whole fp8 range; edge blocks are padded with zeros, which change
no block's largest magnitude. The arithmetic is vLLM's reference (``per_block_cast_to_fp8``,
vllm/utils/deep_gemm.py in vLLM 0.33), so a quantization here is bit-identical to one there.

Norms, embeddings, MoE routers, the LM head and every bias stay in their dtype: DeepSeek-V3's FP8 checkpoint
keeps them in bf16, and the engines build those layers without the quantization config.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# A block of zeros would get a zero scale and 0 / 0 values; vLLM's reference clamps the same way.
MIN_BLOCK_AMAX = 1e-4

# The on-disk names that stay unquantized although they are 2-D weights: embeddings and the LM head (their
# rows are looked up or their errors land on every logit), MoE routers (small, and their errors flip expert
# choices), DeepSeek's multi-token-prediction projection and head (vLLM builds them as plain layers) and a
# vision tower (the engines build it without the quantization config).
KEPT_WEIGHT_PATTERN = re.compile(
    r"(embed_tokens|lm_head|norm|\.gate\.weight$|shared_expert_gate|\.router\.|eh_proj|shared_head|^visual\.)")
EMBEDDING_OR_NORM = re.compile(r"(embed_tokens|norm)")


def quantization_config(modules_to_not_convert: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` entry of ``config.json`` that vLLM's and SGLang's ``Fp8Config.from_config``
    read (vllm/model_executor/layers/quantization/fp8.py, sglang/srt/layers/quantization/fp8.py):
    ``modules_to_not_convert`` names the linear modules (``model.layers.0.mlp.gate``) kept unquantized, which
    the engines then build without FP8."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK_SIZE)}
    kept = sorted(set(modules_to_not_convert))
    if kept:
        config["modules_to_not_convert"] = kept
    return config


def is_quantized(name: str, shape: Iterable[int]) -> bool:
    """Whether the on-disk weight ``name`` of ``shape`` travels as FP8: the 2-D ``.weight`` of a linear layer
    that ``KEPT_WEIGHT_PATTERN`` does not keep."""
    return name.endswith(".weight") and len(tuple(shape)) == 2 and not KEPT_WEIGHT_PATTERN.search(name)


def kept_linear_modules(names_and_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
    """The modules of 2-D ``.weight`` tensors that stay unquantized apart from embeddings and norms (routers,
    the LM head): ``quantization_config``'s ``modules_to_not_convert``."""
    return sorted(name.removesuffix(".weight") for name, shape in names_and_shapes
                  if name.endswith(".weight") and len(tuple(shape)) == 2 and not is_quantized(name, shape)
                  and not EMBEDDING_OR_NORM.search(name))


def scale_name(name: str) -> str:
    """The scale's name of the quantized weight ``name``: ``x.weight`` -> ``x.weight_scale_inv``."""
    return name + SCALE_SUFFIX


def scale_shape(shape: Iterable[int]) -> tuple[int, int]:
    """[ceil(M/128), ceil(N/128)]: the scales of a weight of ``shape`` [M, N]."""
    rows, cols = shape
    return -(-rows // BLOCK_SIZE[0]), -(-cols // BLOCK_SIZE[1])


def _padded_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [M, N] zero-padded to whole blocks, viewed as [M/128, 128, N/128, 128]."""
    rows, cols = weight.shape
    block_rows, block_cols = scale_shape(weight.shape)
    padded = weight.new_zeros(block_rows * BLOCK_SIZE[0], block_cols * BLOCK_SIZE[1])
    padded[:rows, :cols] = weight
    return padded.view(block_rows, BLOCK_SIZE[0], block_cols, BLOCK_SIZE[1])


@torch.no_grad()
def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [M, N] (any float dtype) -> ``(fp8 [M, N], scale_inv fp32 [ceil(M/128), ceil(N/128)])``."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks = _padded_blocks(weight)
    scale_inv = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(MIN_BLOCK_AMAX) / FP8_MAX
    quantized = (blocks * (1.0 / scale_inv)).to(FP8_DTYPE)
    return (quantized.view(blocks.shape[0] * BLOCK_SIZE[0], -1)[:rows, :cols].contiguous(),
            scale_inv.view(blocks.shape[0], blocks.shape[2]))


@torch.no_grad()
def dequantize_blockwise(quantized: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 [M, N] * scale_inv [ceil(M/128), ceil(N/128)]`` block by block, in fp32, then cast to ``dtype``."""
    if tuple(scale_inv.shape) != scale_shape(quantized.shape):
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not fit a weight of shape "
                         f"{tuple(quantized.shape)}; expected {scale_shape(quantized.shape)}")
    rows, cols = quantized.shape
    scales = scale_inv.float().repeat_interleave(BLOCK_SIZE[0], 0).repeat_interleave(BLOCK_SIZE[1], 1)
    return (quantized.float() * scales[:rows, :cols]).to(dtype)


def fp8_rounded(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as an FP8 engine serves it: quantized blockwise and dequantized, in ``weight``'s dtype."""
    return dequantize_blockwise(*quantize_blockwise(weight), dtype=weight.dtype)


def quantized_stream(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An export stream with every quantized weight replaced by its FP8 tensor followed at once by its scales
    (same name + ``_scale_inv``); the other tensors pass unchanged, so any transport carries it as it is."""
    for name, tensor in named_tensors:
        if is_quantized(name, tensor.shape):
            quantized, scale_inv = quantize_blockwise(tensor)
            yield name, quantized
            yield scale_name(name), scale_inv
        else:
            yield name, tensor


def quantized_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``quantized_stream`` bucket by bucket (a weight and its scales stay in one bucket): the bridge's bucketed
    export (``export_hf_buckets``) as an FP8 engine receives it, at about half the bytes."""
    for bucket in buckets:
        yield list(quantized_stream(bucket))


def fp8_nbytes(shape: Iterable[int]) -> int:
    """Bytes of a quantized weight of ``shape`` [M, N] on the wire or in an engine: fp8 values plus fp32 scales."""
    rows, cols = shape
    block_rows, block_cols = scale_shape((rows, cols))
    return rows * cols + 4 * block_rows * block_cols

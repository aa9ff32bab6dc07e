"""Engines serving blockwise FP8 weights (``weight_dtype="fp8"``): update streams and checkpoints.

FP8 weights arrive as ``name`` (``float8_e4m3fn``) followed at once by ``name_scale_inv`` (fp32, one scale per
128 x 128 block, ``rlmega.bridge.fp8``); an engine that computes in a wider dtype (the hf engine on CPU)
dequantizes them. A quantizable weight that arrives in full precision is rounded through FP8 on the way in, so the
engine serves the same weights whichever form the sender chose. vLLM and SGLang build FP8 layers only for an FP8
checkpoint, which ``write_fp8_checkpoint`` makes of a full-precision one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PreTrainedModel

from rlmega.bridge.fp8 import (FP8_DTYPE, SCALE_SUFFIX, dequantize_blockwise, fp8_rounded, is_quantized,
                               kept_linear_modules, quantization_config, quantize_blockwise, quantized_stream,
                               scale_name)
from rlmega.rollout.hf_weights import HFWeightMap
from rlmega.rollout.weight_updates import check_shape

WEIGHT_DTYPES = ("auto", "fp8")
INDEX_FILE = "model.safetensors.index.json"


def check_weight_dtype(weight_dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")


def served_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                  fp8: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as the engine serves it: FP8 pairs dequantized to fp32 under the weight's name; with ``fp8``,
    full-precision quantizable weights rounded through FP8. Raises ``ValueError`` on an FP8 weight whose scales do
    not follow it, or scales with no FP8 weight before them."""
    waiting: tuple[str, torch.Tensor] | None = None
    for name, tensor in named_tensors:
        if waiting is not None:
            weight_name, quantized = waiting
            if name != scale_name(weight_name):
                raise ValueError(f"FP8 weight {weight_name!r} arrived without its scales: {scale_name(weight_name)!r}"
                                 f" must come right after it, got {name!r}")
            waiting = None
            yield weight_name, dequantize_blockwise(quantized, tensor)
        elif tensor.dtype == FP8_DTYPE:
            waiting = (name, tensor)
        elif name.endswith(SCALE_SUFFIX):
            raise ValueError(f"FP8 scales {name!r} arrived without their weight "
                             f"{name.removesuffix(SCALE_SUFFIX)!r} in float8_e4m3fn right before them")
        elif fp8 and is_quantized(name, tensor.shape) and tensor.is_floating_point():
            yield name, fp8_rounded(tensor)
        else:
            yield name, tensor
    if waiting is not None:
        raise ValueError(f"FP8 weight {waiting[0]!r} arrived without its scales {scale_name(waiting[0])!r} "
                         "(the stream ended)")


def is_fp8_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether the HF checkpoint ``directory`` stores blockwise FP8 weights (config.json's ``quantization_config``
    with ``quant_method: fp8``, as ``rlmega convert mcore-to-hf --fp8`` writes)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


@torch.no_grad()
def load_fp8_checkpoint(directory: str | os.PathLike, loader, dtype: torch.dtype, **model_kwargs) -> PreTrainedModel:
    """The model of an FP8 checkpoint with its weights dequantized to ``dtype``. transformers' own FP8 loading
    needs accelerate, and a GPU to keep the weights in FP8 (it dequantizes on CPU, the same arithmetic as here)."""
    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config  # built unquantized, then filled with the dequantized weights
    model = loader.from_config(config, dtype=dtype, **model_kwargs)
    weights = HFWeightMap(model)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    filled: set[str] = set()
    for name, tensor in served_stream(sorted(tensors.items()), fp8=False):
        target = weights.resolve(name)
        check_shape(name, tensor, target.shape)
        weights.tensors[target.tensor_name].data[target.index].copy_(tensor)
        filled.update(target.slots)
    missing = weights.slots - filled
    if missing:
        raise ValueError(f"FP8 checkpoint {directory} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return model


def for_fp8_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]],
                       stored: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """An update stream in an FP8 checkpoint's format, whose tensor names are ``stored``: a full-precision weight
    stored quantized is quantized here (an FP8 engine's loader copies the bytes it is given into its FP8
    parameter, so it must never see a wider dtype there); FP8 pairs and the other tensors pass as they are."""
    stored = frozenset(stored)
    for name, tensor in named_tensors:
        if tensor.dtype != FP8_DTYPE and scale_name(name) in stored:
            quantized, scale_inv = quantize_blockwise(tensor)
            yield name, quantized
            yield scale_name(name), scale_inv
        else:
            yield name, tensor


def write_fp8_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """A copy of the HF checkpoint ``source`` in ``target`` (an empty directory) with its linear weights as
    blockwise FP8 and config.json's ``quantization_config``: what vLLM and SGLang start an FP8 engine from. One
    safetensors file in memory at a time."""
    source, target = Path(source), Path(target)
    names_and_shapes: list[tuple[str, tuple[int, ...]]] = []  # of every stored tensor
    weight_map: dict[str, str] = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors = dict(quantized_stream(load_file(file).items()))
        save_file(tensors, target / file.name, metadata={"format": "pt"})
        weight_map.update({name: file.name for name in tensors})
        names_and_shapes += [(name, tuple(t.shape)) for name, t in tensors.items()]
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", INDEX_FILE):
            shutil.copy2(file, target / file.name)
    if (source / INDEX_FILE).is_file():
        index = json.loads((source / INDEX_FILE).read_text())
        (target / INDEX_FILE).write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(kept_linear_modules(names_and_shapes))
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return target

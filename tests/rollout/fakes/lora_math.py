"""What both engines' LoRA computes, for the fakes: a PEFT directory read as both read it (``r``, ``lora_alpha``,
scale ``alpha / r``; adapter_model.safetensors) and the model computing with ``W + scale * B @ A`` while a request
names the adapter (the engines' kernels add ``scale * B (A x)``: the same product)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

PREFIX = "base_model.model."


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "adapter_config.json").read_text())


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(path) / "adapter_model.safetensors")


def module_of(name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``q_proj``."""
    return name.removesuffix(".weight").rsplit(".", 2)[-2]


def deltas(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weight name -> ``scale * B @ A`` (fp32)."""
    scale = config["lora_alpha"] / config["r"]
    found = {}
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
            b = tensors[f"{PREFIX}{module}.lora_B.weight"]
            found[f"{module}.weight"] = scale * (b.float() @ a.float())
    return found


@contextlib.contextmanager
def applied(model, weight_deltas: dict[str, torch.Tensor], prefix_cache: dict):
    """``model`` (a ``TinyCausalLM``) computing with its weights plus ``weight_deltas``, and the adapter's own
    ``prefix_cache`` (both engines key cached KV by adapter), restored afterwards."""
    weight_map, saved = model.weight_map, []
    base_cache, model.prefix_cache = model.prefix_cache, prefix_cache
    try:
        for name, delta in weight_deltas.items():
            target = weight_map.resolve(name)
            param = weight_map.tensors[target.tensor_name]
            saved.append((param, target.index, param.data[target.index].clone()))
            param.data[target.index] += delta.to(param.dtype)
        yield
    finally:
        for param, index, original in reversed(saved):
            param.data[index].copy_(original)
        model.prefix_cache = base_cache

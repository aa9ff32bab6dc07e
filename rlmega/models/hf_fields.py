"""What every architecture adapter reads from a Hugging Face ``config.json`` alike: the config's type, the
refusal of what Megatron cannot build exactly, RoPE, the activation, and the fields all supported
architectures share."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

HFConfig = dict[str, Any]


class UnsupportedModelError(ValueError):
    """The HF config asks for something rlmega cannot build exactly."""


T = TypeVar("T")


def forward_only(weights_only: bool, setting: Callable[[], T], stand_in: T) -> T:
    """``setting()``, the Megatron fields of a setting that only the forward pass uses (routing, RoPE,
    activation, norm epsilon). When only weights are handled (conversion: no forward pass), a setting
    Megatron cannot reproduce changes no tensor, so ``stand_in`` takes its place instead of a refusal."""
    try:
        return setting()
    except UnsupportedModelError:
        if not weights_only:
            raise
        return stand_in


def rope(hf: HFConfig) -> tuple[float, float | None]:
    """(rope base, llama-3 scaling factor or None), from transformers 5 or 4 style configs."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        # Megatron implements llama-3 scaling with these constants fixed; refuse anything else.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        different = {k: rope.get(k) for k, v in fixed.items() if rope.get(k, v) != v}
        if different:
            raise UnsupportedModelError(f"llama3 RoPE scaling with {different} is not supported; supported: {fixed}")
        return float(theta), float(rope.get("factor", 8.0))
    raise UnsupportedModelError(f"rope_type={kind!r} is not supported; supported: 'default', 'llama3'")


# Fields every supported architecture shares: SwiGLU MLPs without biases, no dropout, and the
# unfused torch code paths (the fused kernels need CUDA; TE picks its own on GPU).
COMMON_FIELDS = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
)


def check_activation(hf: HFConfig) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r} is not supported; supported: 'silu'")

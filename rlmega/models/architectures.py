"""Hugging Face ``config.json`` -> ``ModelSpec``, one adapter per architecture.

``ARCHITECTURES`` maps the HF ``architectures`` entry to its adapter; ``model_spec_from_hf`` picks
the adapter and says which ones exist when the checkpoint's is not among them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Union

import torch

from rlmega.models.deepseek import deepseek_v3
from rlmega.models.spec import ModelSpec

HFConfig = dict[str, Any]


class UnsupportedModelError(ValueError):
    """The HF config asks for something rlmega cannot build exactly."""


def _rope(hf: HFConfig) -> tuple[float, float | None]:
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


def _dense(hf: HFConfig, *, qkv_bias: bool, qk_layernorm: bool) -> ModelSpec:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r} is not supported; supported: 'silu'")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = _rope(hf)
    config = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        **COMMON_FIELDS,
    )
    return ModelSpec(
        architecture=hf["architectures"][0],
        config=config,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        rotary_base=theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling_factor=scaling,
    )


def _with_experts(spec: ModelSpec, *, num_experts: int, topk: int, expert_ffn: int,
                  normalize_topk: bool, aux_loss_coeff: float) -> ModelSpec:
    config = dict(
        spec.config,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=expert_ffn,
        # HF either renormalises the top-k softmax probabilities (= softmax over the top-k logits,
        # Megatron's default) or keeps the full-softmax values (Megatron's pre-softmax).
        moe_router_pre_softmax=not normalize_topk,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_grouped_gemm=False,
    )
    return dataclasses.replace(spec, config=config)


def llama(hf: HFConfig) -> ModelSpec:
    return _dense(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=False)


def qwen2(hf: HFConfig) -> ModelSpec:
    return _dense(hf, qkv_bias=True, qk_layernorm=False)


def qwen3(hf: HFConfig) -> ModelSpec:
    return _dense(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=True)


def qwen3_moe(hf: HFConfig) -> ModelSpec:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            "Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not supported"
        )
    return _with_experts(
        # Hub checkpoints say num_experts; transformers 5 writes the same field as num_local_experts.
        qwen3(hf), num_experts=hf.get("num_experts") or hf["num_local_experts"], topk=hf["num_experts_per_tok"],
        expert_ffn=hf["moe_intermediate_size"], normalize_topk=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
    )


def mixtral(hf: HFConfig) -> ModelSpec:
    return _with_experts(
        llama(hf), num_experts=hf["num_local_experts"], topk=hf["num_experts_per_tok"],
        expert_ffn=hf["intermediate_size"], normalize_topk=True,
        aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-2),
    )


ARCHITECTURES: dict[str, Callable[[HFConfig], ModelSpec]] = {
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
    "DeepseekV3ForCausalLM": deepseek_v3,
}


def read_hf_config(source: Union[str, Path, HFConfig, Any]) -> HFConfig:
    """A config dict from a checkpoint directory, a config.json path, a dict or a transformers config."""
    if isinstance(source, dict):
        return source
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no HF config at {path}; pass a checkpoint directory or its config.json")
    return json.loads(path.read_text())


def model_spec_from_hf(source: Union[str, Path, HFConfig, Any]) -> ModelSpec:
    """The ``ModelSpec`` of an HF checkpoint; unknown architectures list the supported ones."""
    hf = read_hf_config(source)
    names = hf.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {names or 'missing'} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[names[0]](hf)

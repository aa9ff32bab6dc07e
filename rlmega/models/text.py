"""The text-only architectures, as Megatron ``ModelSpec``s: Llama, Qwen2, Qwen3 (dense layers) and
Qwen3-MoE, Mixtral (experts)."""

from __future__ import annotations

import dataclasses

from rlmega.models.hf_fields import COMMON_FIELDS, HFConfig, UnsupportedModelError, check_activation, forward_only, rope
from rlmega.models.spec import ModelSpec


def _dense(hf: HFConfig, *, qkv_bias: bool, qk_layernorm: bool, weights_only: bool) -> ModelSpec:
    forward_only(weights_only, lambda: check_activation(hf), None)
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = forward_only(weights_only, lambda: rope(hf), (float(hf.get("rope_theta", 10000.0)), None))
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


def llama(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
    return _dense(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=False, weights_only=weights_only)


def qwen2(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
    return _dense(hf, qkv_bias=True, qk_layernorm=False, weights_only=weights_only)


def qwen3(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
    return _dense(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=True, weights_only=weights_only)


def qwen3_moe(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            "Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not supported"
        )
    return _with_experts(
        # Hub checkpoints say num_experts; transformers 5 writes the same field as num_local_experts.
        qwen3(hf, weights_only), num_experts=hf.get("num_experts") or hf["num_local_experts"], topk=hf["num_experts_per_tok"],
        expert_ffn=hf["moe_intermediate_size"], normalize_topk=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
    )


def mixtral(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
    return _with_experts(
        llama(hf, weights_only), num_experts=hf["num_local_experts"], topk=hf["num_experts_per_tok"],
        expert_ffn=hf["intermediate_size"], normalize_topk=True,
        aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-2),
    )

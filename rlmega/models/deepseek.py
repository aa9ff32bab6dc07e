"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): Multi-Latent Attention, sigmoid-routed MoE with shared
experts and a score-correction bias, dense first layers, and multi-token prediction (MTP) layers.

Each HF behaviour is mapped to the Megatron-Core option that reproduces it exactly; anything that
has no exact Megatron twin raises ``UnsupportedModelError`` naming the field. Settings that only the
forward pass uses (activation, norm epsilon, RoPE, routing) are refused for training but not when only
weights are converted (``weights_only``; ``hf_fields.forward_only``), since no tensor depends on them.
"""

from __future__ import annotations

from rlmega.models import hf_fields
from rlmega.models.spec import ModelSpec

# HF builds q_a_layernorm / kv_a_layernorm with this eps whatever rms_norm_eps says; Megatron uses
# one eps for every norm, so the two must agree.
_HF_LATENT_NORM_EPS = 1e-6


def _unsupported(message: str) -> hf_fields.UnsupportedModelError:
    return hf_fields.UnsupportedModelError(f"DeepseekV3ForCausalLM: {message}")


_PLAIN_ROPE = dict(rope_type="rope", rotary_base=10000.0, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)


def _rope_fields(hf: hf_fields.HFConfig) -> dict:
    """MLATransformerConfig RoPE fields for HF's ``rope_parameters`` (or legacy ``rope_scaling``)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not hf.get("rope_interleave", True):
        # Megatron's MLA always reads the rotary dims as interleaved pairs, as HF does by default.
        raise _unsupported("rope_interleave=false is not supported; supported: true")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported; supported: 1.0")
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise _unsupported(f"rope_type={kind!r} is not supported; supported: 'default', 'yarn'")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise _unsupported("yarn RoPE needs original_max_position_embeddings")
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    if rope.get("attention_factor") is not None:
        raise _unsupported("yarn attention_factor is not supported; Megatron derives it from factor and mscale")
    if not rope.get("truncate", True):
        raise _unsupported("yarn truncate=false is not supported; Megatron rounds the correction range")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # HF scales cos/sin by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) only when
    # both are set (else by get_mscale(factor)), and the softmax by get_mscale(factor, mscale_all_dim)^2
    # whenever mscale_all_dim is set; Megatron always does both with its two fields.
    if not (mscale and mscale_all_dim):
        if mscale_all_dim or mscale not in (None, 1.0):
            raise _unsupported(
                f"yarn with mscale={mscale}, mscale_all_dim={mscale_all_dim} is not supported; "
                "set both, or leave mscale_all_dim unset and mscale unset or 1.0"
            )
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(
        rope_type="yarn",
        rotary_base=theta,
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
    )


def _router_fields(hf: hf_fields.HFConfig) -> dict:
    """Sigmoid top-k routing with HF's e_score_correction_bias and scaling (the router's tensors)."""
    return dict(
        num_moe_experts=hf["n_routed_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_dtype="fp32",  # HF computes router logits in fp32 whatever the model dtype
    )


def _routing_fields(hf: hf_fields.HFConfig) -> dict:
    """How the router picks experts: renormalisation and group-limited routing (forward pass only)."""
    topk = hf["num_experts_per_tok"]
    normalize = bool(hf.get("norm_topk_prob", True))
    # Megatron renormalises sigmoid top-k scores exactly when k > 1.
    if normalize != (topk > 1):
        raise _unsupported(f"norm_topk_prob={normalize} with num_experts_per_tok={topk} is not supported; "
                           "supported: norm_topk_prob=true with k > 1, or false with k = 1")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups == 1:
        return {}
    # HF ranks groups by the sum of their top-2 scores; Megatron by the top (k / topk_group).
    if topk // group_topk != 2:
        raise _unsupported(f"num_experts_per_tok={topk} with topk_group={group_topk} is not supported for training "
                           "(Megatron ranks expert groups by their top num_experts_per_tok // topk_group scores, "
                           "HF by their top 2); group-limited routing needs num_experts_per_tok // topk_group == 2 "
                           "(converting the weights works: no tensor depends on it)")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)


def _check_forward(hf: hf_fields.HFConfig) -> None:
    hf_fields.check_activation(hf)
    eps = hf.get("rms_norm_eps", 1e-6)
    if eps != _HF_LATENT_NORM_EPS:
        raise _unsupported(f"rms_norm_eps={eps} is not supported; HF's latent norms always use "
                           f"{_HF_LATENT_NORM_EPS} and Megatron uses one eps for all norms")


def _mtp_fields(hf: hf_fields.HFConfig) -> dict:
    """Multi-token prediction: HF's MTP layer k is the checkpoint's model.layers.{num_hidden_layers + k}."""
    mtp_layers = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    if not mtp_layers:
        return {}
    if hf.get("tie_word_embeddings"):
        raise _unsupported("tie_word_embeddings=true with num_nextn_predict_layers > 0 is not supported")
    if (hf.get("first_k_dense_replace") or 0) > hf["num_hidden_layers"]:
        # HF's MTP layers would then be dense; Megatron builds them like the last decoder layer (MoE).
        raise _unsupported(f"first_k_dense_replace={hf['first_k_dense_replace']} > num_hidden_layers "
                           "with num_nextn_predict_layers > 0 is not supported")
    # The MTP loss weight (lambda) DeepSeek-V3 ended pre-training with (0.3 for the first 10T tokens).
    return dict(mtp_num_layers=mtp_layers, mtp_loss_scaling_factor=0.1)


def deepseek_v3(hf: hf_fields.HFConfig, weights_only: bool = False) -> ModelSpec:
    forward_only = hf_fields.forward_only
    forward_only(weights_only, lambda: _check_forward(hf), None)
    if hf.get("attention_bias"):
        raise _unsupported("attention_bias=true is not supported (Megatron's MLA projections have no bias)")
    eps = hf.get("rms_norm_eps", 1e-6)
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise _unsupported(f"num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads} "
                           "is not supported")
    layers = hf["num_hidden_layers"]
    shared = hf.get("n_shared_experts") or 0
    if shared < 1:
        raise _unsupported(f"n_shared_experts={shared} is not supported; supported: 1 or more")
    dense_layers = min(hf.get("first_k_dense_replace") or 0, layers)  # HF: layer i is MoE iff i >= k
    config = dict(
        num_layers=layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=heads,
        multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        # The local spec builds the q/kv latent norms only with qk_layernorm.
        qk_layernorm=True,
        layernorm_epsilon=eps,
        **hf_fields.COMMON_FIELDS,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"],
        moe_layer_freq=[0] * dense_layers + [1] * (layers - dense_layers),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        # DeepSeek-V3's sequence-wise balance loss; its released config.json says aux_loss_alpha.
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=hf.get("aux_loss_alpha", 1e-3),
        **_router_fields(hf),
        **forward_only(weights_only, lambda: _routing_fields(hf), {}),
        **forward_only(weights_only, lambda: _rope_fields(hf), _PLAIN_ROPE),
        **_mtp_fields(hf),
    )
    return ModelSpec(
        architecture=hf["architectures"][0],
        config=config,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        rotary_base=config["rotary_base"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )

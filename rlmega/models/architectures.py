"""Hugging Face ``config.json`` -> ``ModelSpec``, one adapter per architecture.

``ARCHITECTURES`` maps the HF ``architectures`` entry to its adapter; ``model_spec_from_hf`` picks
the adapter and says which ones exist when the checkpoint's is not among them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, TypeVar, Union

import torch

from rlmega.models.deepseek import deepseek_v3
from rlmega.models.reward_head import score_head_from_hf
from rlmega.models.spec import ModelSpec
from rlmega.models.vision_language import qwen2_5_vl

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


def check_activation(hf: HFConfig) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r} is not supported; supported: 'silu'")


def _dense(hf: HFConfig, *, qkv_bias: bool, qk_layernorm: bool, weights_only: bool) -> ModelSpec:
    forward_only(weights_only, lambda: check_activation(hf), None)
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = forward_only(weights_only, lambda: _rope(hf), (float(hf.get("rope_theta", 10000.0)), None))
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


def _sequence_classifier(causal_lm: Callable[..., ModelSpec]) -> Callable[..., ModelSpec]:
    """The adapter of ``causal_lm``'s ``*ForSequenceClassification`` twin: the same trunk, the score
    head in the LM head's place (never tied to the embedding: it has no vocabulary)."""

    def adapter(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
        return dataclasses.replace(causal_lm(hf, weights_only), tie_word_embeddings=False,
                                   score_head=score_head_from_hf(hf))

    return adapter


# Each adapter takes the config and ``weights_only`` (see ``forward_only``).
ARCHITECTURES: dict[str, Callable[..., ModelSpec]] = {
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
    "DeepseekV3ForCausalLM": deepseek_v3,
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl,
    "LlamaForSequenceClassification": _sequence_classifier(llama),
    "Qwen2ForSequenceClassification": _sequence_classifier(qwen2),
    "Qwen3ForSequenceClassification": _sequence_classifier(qwen3),
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


MTP_MODES = ("auto", "on", "off")


def model_spec_from_hf(source: Union[str, Path, HFConfig, Any], *, mtp: str = "auto",
                       weights_only: bool = False) -> ModelSpec:
    """The ``ModelSpec`` of an HF checkpoint (a causal LM, or a sequence classifier such as a reward
    model); unknown architectures list the supported ones.

    ``mtp`` (multi-token-prediction layers that config.json announces, DeepSeek-V3): ``on`` builds
    them, ``off`` does not (their weights, if any, are left unread), ``auto`` builds them when
    ``source`` is a checkpoint directory whose weights hold them, or holds no weights at all, and
    otherwise builds without them, saying so in ``spec.notes``. ``weights_only``: settings that only
    the forward pass uses are not refused (``forward_only``); conversion, never training.
    """
    if mtp not in MTP_MODES:
        raise UnsupportedModelError(f"mtp={mtp!r} is not one of {', '.join(MTP_MODES)}")
    hf = read_hf_config(source)
    names = hf.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {names or 'missing'} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    hf, notes, unused = _resolve_mtp(hf, source, mtp)
    spec = ARCHITECTURES[names[0]](hf, weights_only)
    return dataclasses.replace(spec, notes=notes, unused_hf_prefixes=unused) if notes or unused else spec


def hf_weight_names(directory: Union[str, Path]) -> set[str] | None:
    """Tensor names of the safetensors checkpoint in ``directory`` (read from the index or the file
    header, no weights), or None when it holds no weights (a config.json only)."""
    directory = Path(directory)
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, "pt") as handle:
            return set(handle.keys())
    return None


def _resolve_mtp(hf: HFConfig, source, mode: str) -> tuple[HFConfig, tuple[str, ...], tuple[str, ...]]:
    """(config as built, notes, HF name prefixes left unread) for ``mode``; only configs announcing
    MTP layers (``num_nextn_predict_layers``) change."""
    field = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
    announced, layers = hf.get(field) or 0, hf.get("num_hidden_layers", 0)
    if not announced or mode == "on":
        return hf, (), ()
    prefixes = tuple(f"model.layers.{layers + k}." for k in range(announced))
    weights = hf_weight_names(source) if isinstance(source, (str, Path)) and Path(source).is_dir() else None
    present = weights is not None and any(name.startswith(prefixes) for name in weights)
    if mode == "auto" and (weights is None or present):
        return hf, (), ()
    without = dict(hf, **{field: 0})
    if mode == "off":
        return without, (), prefixes if present else ()
    note = (f"config.json says {field}={announced}, but {source} holds no MTP weights ({prefixes[0]}*, as "
            "transformers' save_pretrained writes it): building without MTP (mtp=auto; on / off decide)")
    return without, (note,), ()

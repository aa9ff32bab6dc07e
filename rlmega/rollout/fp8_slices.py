"""Whether an FP8 engine's tensor parallelism cuts every blockwise-quantized layer on a 128-block boundary.

A tensor-parallel engine gives each rank a slice of every linear layer: the output rows of a column-parallel one
(q, k, v, gate, up, DeepSeek's q_b / kv_b, experts' gate and up), the input columns of a row-parallel one (o, down,
experts' down). With 128 x 128 FP8 blocks (``rlmega.bridge.fp8``) a slice must hold whole blocks, or the engine
refuses the checkpoint at load: vLLM 0.33 ``validate_fp8_block_shape`` / ``validate_fp8_block_shape_moe``
(vllm/model_executor/layers/quantization/utils/fp8_utils.py: a row-parallel slice when TP > 1; each output slice of a
TP-split or merged (qkv, gate_up) layer, the last part of a merged one exempt at TP 1; the experts' intermediate
slice always, and its down input when TP > 1) and SGLang 0.5.23 the same (sglang/srt/layers/quantization/fp8.py).
KV heads fewer than the TP size are replicated, one per rank (vLLM's ``QKVParallelLinear``); experts under expert
parallelism are whole on their rank (their TP is 1).
"""

from __future__ import annotations

from typing import Optional

from rlmega.bridge.fp8 import BLOCK_SIZE

BLOCK = BLOCK_SIZE[0]
LARGEST_TP_LISTED = 64


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _expert_size(config: dict) -> Optional[int]:
    """The experts' intermediate size (Mixtral's experts use ``intermediate_size``); None for a dense model."""
    if config.get("num_local_experts"):
        return config["intermediate_size"]
    if config.get("num_experts") or config.get("n_routed_experts"):
        return config.get("moe_intermediate_size")
    return None


def _layers(config: dict, tp: int) -> list[tuple[str, int, str]]:
    """(HF module, its size along the TP split, how it is split) of each kind of quantized linear layer:
    "merged" (checked at any TP), "column" and "row" (checked when TP > 1)."""
    heads = config["num_attention_heads"]
    if config.get("kv_lora_rank"):  # DeepSeek's multi-latent attention: q_a / kv_a are replicated, not split
        query = heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        layers = [("self_attn.q_b_proj" if config.get("q_lora_rank") else "self_attn.q_proj", query, "column"),
                  ("self_attn.kv_b_proj", heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), "column"),
                  ("self_attn.o_proj", heads * config["v_head_dim"], "row")]
    else:
        kv_heads = config.get("num_key_value_heads") or heads
        layers = [("self_attn.q_proj", heads * _head_dim(config), "merged"),
                  # fewer KV heads than ranks: one (replicated) head per rank
                  ("self_attn.k_proj", _head_dim(config) * max(kv_heads, tp), "merged"),
                  ("self_attn.o_proj", heads * _head_dim(config), "row")]
    dense_layers = not _expert_size(config) or bool(
        config.get("first_k_dense_replace") or config.get("mlp_only_layers")
        or config.get("decoder_sparse_step", 1) > 1 or config.get("moe_layer_freq", 1) > 1)
    if dense_layers and not config.get("num_local_experts"):
        layers += [("mlp.gate_proj", config["intermediate_size"], "merged"),
                   ("mlp.down_proj", config["intermediate_size"], "row")]
    shared = config.get("shared_expert_intermediate_size") or \
        (config.get("n_shared_experts") or 0) * (config.get("moe_intermediate_size") or 0)
    if shared:
        layers += [("mlp.shared_expert.gate_proj", shared, "merged"), ("mlp.shared_expert.down_proj", shared, "row")]
    return layers


def _first_bad_slice(config: dict, tp: int, expert_parallel: bool) -> Optional[tuple[str, int, int, str]]:
    """(layer, size, the rank's slice, how it is split) of the first layer ``tp`` does not cut into whole blocks
    (slice 0: not even divisible by ``tp``)."""
    for layer, size, split in _layers(config, tp):
        if split != "merged" and tp == 1:
            continue
        part = size // tp if size % tp == 0 else 0
        if part == 0 or part % BLOCK:
            return layer, size, part, split
    experts = _expert_size(config)
    if experts:
        expert_tp = 1 if expert_parallel else tp
        part = experts // expert_tp if experts % expert_tp == 0 else 0
        if part == 0 or part % BLOCK:
            return "mlp.experts.*.gate_proj/up_proj/down_proj", experts, part, "merged"
    return None


def fp8_tp_problem(config: dict, tp: int, expert_parallel: bool = False) -> Optional[str]:
    """What keeps an FP8 engine of TP ``tp`` from loading the model of HF ``config`` (its text config), in one
    sentence, or None."""
    bad = _first_bad_slice(config, tp, expert_parallel)
    if bad is None:
        return None
    layer, size, part, split = bad
    working = [candidate for candidate in range(1, LARGEST_TP_LISTED + 1)
               if _first_bad_slice(config, candidate, expert_parallel) is None]
    what = "input columns" if split == "row" else "output rows"
    cut = f"slices of {part}" if part else "unequal slices"
    experts = "" if expert_parallel or not _expert_size(config) else \
        ", spread the experts with rollout.expert_parallel_size"
    return (f"rollout.weight_dtype=fp8 quantizes {layer} in {BLOCK} x {BLOCK} blocks, and tensor_parallel_size={tp} "
            f"cuts its {size} {what} into {cut}, not a multiple of {BLOCK} (the engine refuses it at load); "
            f"set rollout.tensor_parallel_size to a size that cuts whole blocks "
            f"({', '.join(map(str, working)) or f'none up to {LARGEST_TP_LISTED}'}){experts}"
            + ", or set rollout.weight_dtype=auto")

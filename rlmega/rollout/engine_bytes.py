"""Bytes each rollout-engine rank must receive per weight update, computed from a HF ``config.json``.

Two numbers per rank: ``whole`` (every rank receives every tensor whole, as rlmega sends today) and
``sliced`` (each rank receives only the part of each tensor it holds). The engine layout is vLLM's and
SGLang's: ``tensor_parallel_size * data_parallel_size`` ranks; attention and dense MLPs are split over
the TP ranks of each DP replica; routed experts are spread over ``expert_parallel_size`` ranks, and
each expert is split over the remaining ``world / expert_parallel_size`` ranks (vLLM's EP is TP x DP,
so experts are then whole).

How each tensor is held (vLLM's layers, which SGLang mirrors):
- column-parallel, split on the output dim: q/k/v_proj (by heads; KV heads are replicated when there
  are fewer than TP ranks), gate/up_proj, MLA's q_b_proj and kv_b_proj, shared experts' gate/up;
- row-parallel, split on the input dim: o_proj, down_proj, shared experts' down_proj;
- vocab-parallel, split on rows: embed_tokens, lm_head;
- replicated: norms, the router and its score bias, MLA's q_a_proj and kv_a_proj_with_mqa;
- routed experts: each expert's gate/up/down on the ranks of its EP group, split over them.

DeepSeek-V3's MTP layer (``num_nextn_predict_layers``) is left out: engines load it only for
speculative decoding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

from rlmega.bridge.fp8 import is_quantized, scale_shape
from rlmega.rollout.engine_common import moe_layer_indices

COLUMN, ROW, VOCAB, REPLICATED, KV_COLUMN, EXPERT_COLUMN, EXPERT_ROW = (
    "column", "row", "vocab", "replicated", "kv_column", "expert_column", "expert_row")


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How one rollout engine spreads over its GPUs."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype_bytes: int = 2
    """bytes per element of the engine's weights (2 for bf16)"""
    weight_dtype: str = "auto"
    """fp8: the linear weights held as blockwise FP8 (``rlmega.bridge.fp8``: a byte per element and fp32 scales
    per 128 x 128 block), the rest in ``dtype_bytes``"""

    def __post_init__(self):
        if self.world_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} must divide tensor_parallel_size x "
                             f"data_parallel_size = {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_tensor_parallel_size(self) -> int:
        return self.world_size // self.expert_parallel_size


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    split: str
    """one of COLUMN, ROW, VOCAB, REPLICATED, KV_COLUMN, EXPERT_COLUMN, EXPERT_ROW"""
    expert: int = -1
    num_experts: int = 0
    num_kv_heads: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class EngineRankBytes:
    layout: EngineLayout
    whole: int
    """bytes of the whole model: what every rank receives today"""
    sliced: tuple[int, ...]
    """per rank, the bytes of the slices it holds"""

    @property
    def max_sliced(self) -> int:
        return max(self.sliced)


def _even_part(length: int, parts: int, index: int) -> int:
    """The length of part ``index`` of ``length`` split into ``parts`` contiguous ceil-sized pieces."""
    size = -(-length // parts)
    return max(0, min(length, (index + 1) * size) - index * size)


def held_numel(tensor: HFTensor, layout: EngineLayout, rank: int) -> int:
    """Elements of ``tensor`` that engine rank ``rank`` holds (rank = dp_rank * tp + tp_rank)."""
    tp = layout.tensor_parallel_size
    tp_rank = rank % tp
    rows, columns = tensor.shape[0], math.prod(tensor.shape[1:])
    if tensor.split == REPLICATED:
        return tensor.numel
    if tensor.split in (COLUMN, VOCAB):
        return _even_part(rows, tp, tp_rank) * columns
    if tensor.split == ROW:
        return rows * _even_part(columns, tp, tp_rank)
    if tensor.split == KV_COLUMN:  # vLLM's QKVParallelLinear: max(1, kv_heads / tp) heads per rank
        head_rows = rows // tensor.num_kv_heads
        return max(1, tensor.num_kv_heads // tp) * head_rows * columns
    etp = layout.expert_tensor_parallel_size
    experts_per_group = tensor.num_experts // layout.expert_parallel_size
    if tensor.expert // experts_per_group != rank // etp:
        return 0
    if tensor.split == EXPERT_COLUMN:
        return _even_part(rows, etp, rank % etp) * columns
    return rows * _even_part(columns, etp, rank % etp)


Box = tuple[tuple[int, int], ...]
"""Per dimension, ``[start, stop)``: a block of a tensor."""


def _part(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``length`` split as ``_even_part`` counts it."""
    size = -(-length // parts)
    return min(length, index * size), min(length, (index + 1) * size)


def held_region(tensor: HFTensor, layout: EngineLayout, rank: int) -> Optional[Box]:
    """The block of ``tensor`` engine rank ``rank`` holds (the whole box when it holds it whole), or None when it
    holds none of it (also past the last of a short split's parts); ``held_numel`` elements, the same split."""
    region = _region(tensor, layout, rank)
    return None if region is None or any(start == stop for start, stop in region) else region


def _region(tensor: HFTensor, layout: EngineLayout, rank: int) -> Optional[Box]:
    whole = tuple((0, size) for size in tensor.shape)
    tp = layout.tensor_parallel_size
    tp_rank = rank % tp
    if tensor.split == REPLICATED:
        return whole
    if tensor.split in (COLUMN, VOCAB):
        return (_part(tensor.shape[0], tp, tp_rank), *whole[1:])
    if tensor.split == ROW:
        return (whole[0], _part(tensor.shape[1], tp, tp_rank), *whole[2:])
    if tensor.split == KV_COLUMN:  # vLLM's QKVParallelLinear: a rank's own heads, or one head shared by tp / heads
        heads, head_rows = tensor.num_kv_heads, tensor.shape[0] // tensor.num_kv_heads
        per_rank = max(1, heads // tp)
        first = tp_rank * per_rank if heads >= tp else tp_rank // (tp // heads)
        return ((first * head_rows, (first + per_rank) * head_rows), *whole[1:])
    etp = layout.expert_tensor_parallel_size
    experts_per_group = tensor.num_experts // layout.expert_parallel_size
    if tensor.expert // experts_per_group != rank // etp:
        return None
    if tensor.split == EXPERT_COLUMN:
        return (_part(tensor.shape[0], etp, rank % etp), *whole[1:])
    return (whole[0], _part(tensor.shape[1], etp, rank % etp), *whole[2:])


def _attention(config: dict, layer: str) -> Iterator[HFTensor]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    attn = f"{layer}.self_attn"
    if "kv_lora_rank" in config:  # DeepSeek's multi-latent attention
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        if q_rank is None:
            yield HFTensor(f"{attn}.q_proj.weight", (heads * (nope + rope), hidden), COLUMN)
        else:
            yield HFTensor(f"{attn}.q_a_proj.weight", (q_rank, hidden), REPLICATED)
            yield HFTensor(f"{attn}.q_a_layernorm.weight", (q_rank,), REPLICATED)
            yield HFTensor(f"{attn}.q_b_proj.weight", (heads * (nope + rope), q_rank), COLUMN)
        yield HFTensor(f"{attn}.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), REPLICATED)
        yield HFTensor(f"{attn}.kv_a_layernorm.weight", (kv_rank,), REPLICATED)
        yield HFTensor(f"{attn}.kv_b_proj.weight", (heads * (nope + v), kv_rank), COLUMN)
        yield HFTensor(f"{attn}.o_proj.weight", (hidden, heads * v), ROW)
        return
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    yield HFTensor(f"{attn}.q_proj.weight", (heads * head_dim, hidden), COLUMN)
    for p in "kv":
        yield HFTensor(f"{attn}.{p}_proj.weight", (kv_heads * head_dim, hidden), KV_COLUMN, num_kv_heads=kv_heads)
    if bias:
        yield HFTensor(f"{attn}.q_proj.bias", (heads * head_dim,), COLUMN)
        for p in "kv":
            yield HFTensor(f"{attn}.{p}_proj.bias", (kv_heads * head_dim,), KV_COLUMN, num_kv_heads=kv_heads)
    yield HFTensor(f"{attn}.o_proj.weight", (hidden, heads * head_dim), ROW)
    if config.get("model_type", "").startswith("qwen3"):
        yield HFTensor(f"{attn}.q_norm.weight", (head_dim,), REPLICATED)
        yield HFTensor(f"{attn}.k_norm.weight", (head_dim,), REPLICATED)


def _dense_mlp(prefix: str, hidden: int, intermediate: int, names=("gate_proj", "up_proj", "down_proj"),
               column=COLUMN, row=ROW, **expert) -> Iterator[HFTensor]:
    gate, up, down = names
    yield HFTensor(f"{prefix}.{gate}.weight", (intermediate, hidden), column, **expert)
    yield HFTensor(f"{prefix}.{up}.weight", (intermediate, hidden), column, **expert)
    yield HFTensor(f"{prefix}.{down}.weight", (hidden, intermediate), row, **expert)


def _is_moe_layer(config: dict, index: int) -> bool:
    return index in moe_layer_indices(config)


def _mlp(config: dict, layer: str, index: int) -> Iterator[HFTensor]:
    hidden = config["hidden_size"]
    if not _is_moe_layer(config, index):
        yield from _dense_mlp(f"{layer}.mlp", hidden, config["intermediate_size"])
        return
    mixtral = config.get("model_type") == "mixtral"
    mlp = f"{layer}.block_sparse_moe" if mixtral else f"{layer}.mlp"
    num_experts = config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]
    expert_size = config["intermediate_size"] if mixtral else config["moe_intermediate_size"]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    yield HFTensor(f"{mlp}.gate.weight", (num_experts, hidden), REPLICATED)
    if config.get("topk_method") == "noaux_tc":
        yield HFTensor(f"{mlp}.gate.e_score_correction_bias", (num_experts,), REPLICATED)
    for expert in range(num_experts):
        yield from _dense_mlp(f"{mlp}.experts.{expert}", hidden, expert_size, names, EXPERT_COLUMN, EXPERT_ROW,
                              expert=expert, num_experts=num_experts)
    if config.get("n_shared_experts"):
        yield from _dense_mlp(f"{mlp}.shared_experts", hidden, config["n_shared_experts"] * expert_size)
    if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE
        yield from _dense_mlp(f"{mlp}.shared_expert", hidden, config["shared_expert_intermediate_size"])
        yield HFTensor(f"{mlp}.shared_expert_gate.weight", (1, hidden), REPLICATED)


def hf_tensors(config: dict) -> Iterator[HFTensor]:
    """Every weight of the HF checkpoint ``config`` describes, with the split engines hold it by."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    yield HFTensor("model.embed_tokens.weight", (vocab, hidden), VOCAB)
    for index in range(config["num_hidden_layers"]):
        layer = f"model.layers.{index}"
        yield HFTensor(f"{layer}.input_layernorm.weight", (hidden,), REPLICATED)
        yield from _attention(config, layer)
        yield HFTensor(f"{layer}.post_attention_layernorm.weight", (hidden,), REPLICATED)
        yield from _mlp(config, layer, index)
    yield HFTensor("model.norm.weight", (hidden,), REPLICATED)
    if not config.get("tie_word_embeddings", False):
        yield HFTensor("lm_head.weight", (vocab, hidden), VOCAB)


def tensor_bytes(tensor: HFTensor, numel: int, layout: EngineLayout) -> int:
    """Bytes of ``numel`` elements of ``tensor`` as the engine holds them (an FP8 weight's slice with its share
    of the scales)."""
    if layout.weight_dtype == "fp8" and is_quantized(tensor.name, tensor.shape):
        scales = 4 * math.prod(scale_shape(tensor.shape))
        return numel + -(-scales * numel // tensor.numel)
    return numel * layout.dtype_bytes


def fp8_stream_fraction(config: dict, dtype_bytes: int = 2) -> float:
    """The bytes of the model's HF tensors with its linear weights in blockwise FP8, over those in ``dtype_bytes``
    per element: what an FP8 weight sync streams, as a share of the unquantized stream."""
    fp8 = engine_rank_bytes(config, EngineLayout(dtype_bytes=dtype_bytes, weight_dtype="fp8")).whole
    return fp8 / engine_rank_bytes(config, EngineLayout(dtype_bytes=dtype_bytes)).whole


def engine_rank_bytes(config: dict, layout: EngineLayout) -> EngineRankBytes:
    """Per engine rank, the bytes of one weight update: whole tensors, and only the slices it holds."""
    num_experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")
    if num_experts and num_experts % layout.expert_parallel_size:
        raise ValueError(f"expert_parallel_size={layout.expert_parallel_size} must divide the {num_experts} experts")
    whole, sliced = 0, [0] * layout.world_size
    for tensor in hf_tensors(config):
        whole += tensor_bytes(tensor, tensor.numel, layout)
        for rank in range(layout.world_size):
            sliced[rank] += tensor_bytes(tensor, held_numel(tensor, layout, rank), layout)
    return EngineRankBytes(layout, whole, tuple(sliced))

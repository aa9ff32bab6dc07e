"""The planner's formulas: memory that no tensor of a built model holds (activations, KV cache) and the
optimizer-state variants, per byte. Everything else the planner reports is measured (``meta_build``).

Activations are the tensors autograd saves for the backward pass, in bf16 (2 bytes), per token of one
micro-batch on one rank, per layer (after Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, with fused attention, so no ``[s, s]`` term, no dropout masks, SwiGLU, and
top-k routing spread evenly over the experts). ``h`` is split over TP ranks under sequence parallelism
(``h/t``), head and FFN widths always (``/t``; experts ``/etp``). Per component:

    norm input 2h/t, QKV input 2h/t, Q K V after RoPE 2(nq + 2nkv)d/t, attention output 2nq d/t, its
    log-sum-exp 4nq/t; MLA: latents 2(qr + 2kvr + dr) (whole on every TP rank), Q K V 2n(2(dn + dr) + dv)/t
    (the up-projections' outputs are not kept: concatenation and RoPE save none of their inputs); dense MLP: norm and FC1 inputs 4h/t, FC1 output 4f/t, activation 2f/t;
    MoE: norm and router inputs 4h/t, router scores 8E/t (fp32), each of k copies of a token: expert input
    2h/t, FC1 output 4fe/(t etp), activation 2fe/(t etp); shared experts as a dense MLP of width fs.

Full recomputation keeps only each unit's input (2h/t per token and layer) for every micro-batch in flight
and, once, the unit the backward pass recomputes; selective recomputation drops the components of the
modules it recomputes (and holds one layer's worth of them once).
The last stage adds its logits (bf16, kept for the backward pass) and the fp32 working set of the chunked
log-softmax (``batching.logprob_chunk_tokens`` tokens at a time, three fp32 tensors).

KV cache per token on one engine GPU, bf16: 2 (K, V) x layers x ceil(nkv / engine tp) x d x 2 bytes; MLA
stores its compressed latent, (kvr + dr) x layers x 2 bytes, whole on every TP rank (vLLM, SGLang).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

BF16 = 2
FP32 = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of a model the formulas need, from its ``ModelSpec``."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    mla: Optional[tuple[int, int, int, int, int]] = None
    """(q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""

    @classmethod
    def of(cls, spec) -> "Shape":
        config = spec.config
        heads = config["num_attention_heads"]
        mla = None
        if config.get("multi_latent_attention"):
            mla = (config.get("q_lora_rank") or 0, config["kv_lora_rank"], config["qk_head_dim"],
                   config["qk_pos_emb_head_dim"], config["v_head_dim"])
        return cls(hidden=config["hidden_size"], heads=heads, kv_heads=config.get("num_query_groups") or heads,
                   head_dim=config.get("kv_channels") or config["hidden_size"] // heads, ffn=config["ffn_hidden_size"],
                   vocab=spec.vocab_size, layers=spec.num_layers, experts=config.get("num_moe_experts") or 0,
                   topk=config.get("moe_router_topk") or 0, expert_ffn=config.get("moe_ffn_hidden_size") or 0,
                   shared_ffn=config.get("moe_shared_expert_intermediate_size") or 0, mla=mla)


# Which recompute module (WorkerConfig.recompute_modules) drops which activation component.
RECOMPUTED_BY = {
    "core_attn": ("attention_lse",),
    "layernorm": ("qkv_input", "mlp_input"),
    "mla_up_proj": ("mla_latents",),
    "mlp": ("fc1_output", "activation"),
    "moe": ("router_scores", "expert_input", "expert_fc1_output", "expert_activation"),
    "moe_act": ("expert_activation",),
    "shared_experts": ("shared_fc1_output", "shared_activation"),
}


def layer_components(shape: Shape, kind: str, tp: int, etp: int, sequence_parallel: bool) -> dict[str, float]:
    """{component: bytes per token} that one layer of ``kind`` ("dense" or "moe") saves for backward."""
    t, hs = tp, shape.hidden / (tp if sequence_parallel else 1)
    parts = {"norm_input": BF16 * hs, "qkv_input": BF16 * hs}
    if shape.mla:
        qr, kvr, dn, dr, dv = shape.mla
        n = shape.heads
        parts["mla_latents"] = BF16 * (qr + 2 * kvr + dr)
        parts["qkv"] = BF16 * n * (2 * (dn + dr) + dv) / t
        parts["attention_output"] = BF16 * n * dv / t
    else:
        parts["qkv"] = BF16 * (shape.heads + 2 * shape.kv_heads) * shape.head_dim / t
        parts["attention_output"] = BF16 * shape.heads * shape.head_dim / t
    parts["attention_lse"] = FP32 * shape.heads / t
    parts["mlp_norm_input"] = BF16 * hs
    parts["mlp_input"] = BF16 * hs
    if kind == "dense":
        parts["fc1_output"] = BF16 * 2 * shape.ffn / t
        parts["activation"] = BF16 * shape.ffn / t
        return parts
    k = shape.topk
    parts["router_scores"] = 2 * FP32 * shape.experts / (tp if sequence_parallel else 1)
    parts["expert_input"] = BF16 * k * hs
    parts["expert_fc1_output"] = BF16 * k * 2 * shape.expert_ffn / (etp * (tp if sequence_parallel else 1))
    parts["expert_activation"] = BF16 * k * shape.expert_ffn / (etp * (tp if sequence_parallel else 1))
    if shape.shared_ffn:
        parts["shared_fc1_output"] = BF16 * 2 * shape.shared_ffn / t
        parts["shared_activation"] = BF16 * shape.shared_ffn / t
    return parts


@dataclasses.dataclass(frozen=True)
class Recompute:
    """``WorkerConfig``'s recomputation settings."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, config) -> "Recompute":
        modules = tuple(config.recompute_modules or (("core_attn",) if config.recompute_granularity == "selective" else ()))
        return cls(config.recompute_granularity, config.recompute_method, config.recompute_num_layers, modules)

    def describe(self) -> str:
        if self.granularity == "full":
            return f"full ({self.method or 'uniform'}, {self.num_layers or 1} layer(s))"
        if self.granularity == "selective":
            return f"selective ({', '.join(self.modules)})"
        return "none"


def chunk_activation_bytes(shape: Shape, kinds: list[str], tokens: int, tp: int, etp: int, sequence_parallel: bool,
                           recompute: Recompute) -> tuple[float, float]:
    """(bytes one micro-batch of ``tokens`` tokens leaves saved in a chunk of layers ``kinds`` until its
    backward pass, bytes the backward pass recomputes at a time) with ``recompute``."""
    full = [sum(layer_components(shape, kind, tp, etp, sequence_parallel).values()) for kind in kinds]
    if not full:
        return 0.0, 0.0
    layer_input = BF16 * shape.hidden / (tp if sequence_parallel else 1)
    if recompute.granularity == "full":
        unit = recompute.num_layers or 1
        if recompute.method == "block":
            kept = min(unit, len(kinds))
            return tokens * (kept * layer_input + sum(full[kept:])), tokens * max(full[:kept] or [0])
        units = math.ceil(len(kinds) / unit)
        return tokens * units * layer_input, tokens * max(sum(full[i:i + unit]) for i in range(0, len(kinds), unit))
    dropped = {name for module in recompute.modules for name in RECOMPUTED_BY.get(module, ())}
    kept = [sum(v for name, v in layer_components(shape, kind, tp, etp, sequence_parallel).items() if name not in dropped)
            for kind in kinds]
    recomputed = [f - k for f, k in zip(full, kept)]
    return tokens * sum(kept), tokens * max(recomputed)


def logits_bytes(shape: Shape, tokens: int, tp: int, chunk_tokens: int, padded_vocab: int, training: bool) -> float:
    """The last stage's logits (bf16, kept for backward when training) and the chunked log-softmax working set."""
    width = padded_vocab / tp
    return BF16 * tokens * width * (2 if training else 1) + 3 * FP32 * min(chunk_tokens, tokens) * width


def forward_only_bytes(shape: Shape, kinds: list[str], tokens: int, tp: int, etp: int, sequence_parallel: bool) -> float:
    """A forward pass without gradients keeps nothing: the largest layer's transient tensors and its
    input and output hidden states."""
    if not kinds:
        return 0.0
    biggest = max(sum(layer_components(shape, kind, tp, etp, sequence_parallel).values()) for kind in set(kinds))
    return tokens * (biggest + 2 * BF16 * shape.hidden / (tp if sequence_parallel else 1))


def in_flight_microbatches(stage: int, pp: int, vpp: int, microbatches: int) -> float:
    """Micro-batches (in units of a whole stage's activations) a pipeline stage holds at its peak:
    1F1B holds ``pp - stage``; the interleaved schedule holds ``(pp - stage - 1) * 2 + (vpp - 1) * pp + 1``
    model chunks (Megatron's warm-up count plus the one running), each ``1 / vpp`` of the stage."""
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(microbatches, pp - stage))
    chunks = min(microbatches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)
    return chunks / vpp


def kv_bytes_per_token(shape: Shape, engine_tp: int) -> float:
    """One token's KV cache on one engine GPU (bf16)."""
    if shape.mla:
        _, kvr, _, dr, _ = shape.mla
        return BF16 * shape.layers * (kvr + dr)
    return 2 * BF16 * shape.layers * math.ceil(shape.kv_heads / engine_tp) * shape.head_dim


# Bytes per element of a parameter's optimizer shard: (on the GPU, in host memory).
OPTIMIZER_VARIANTS = {
    "adam": (12, 0),
    "precision_aware": (6, 0),
    "cpu_offload": (0, 16),
}
"""adam: Megatron's default, fp32 master weight and two fp32 Adam moments (4 + 4 + 4). precision_aware:
``use_precision_aware_optimizer`` with bf16 moments and the master weight stored as the 16 bits bf16
parameters lack (``store_param_remainders``: 2 + 2 + 2; needs transformer-engine's FusedAdam).
cpu_offload: ``optimizer_cpu_offload`` with fraction 1, the fp32 master weight, moments and a fp32
gradient copy in host memory (4 + 4 + 4 + 4) and stepped there."""

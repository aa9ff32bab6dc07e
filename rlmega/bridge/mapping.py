"""Which HF tensors make each Megatron parameter, and how.

Megatron parameters are named canonically: the layer index is the global one (Megatron's own
``layer_number - 1``, so pipeline and virtual stages, even or not, need no arithmetic here; an MTP
layer takes its transformer layer's, see ``_mtp_rules``), expert indices are global, and the
local-spec names are used (the TE spec's fused-norm names are translated by ``canonical_te_name``).
A ``Rule`` pairs a canonical name pattern with HF name templates and a transform.

Transforms convert between the HF tensors and the *TP-sharded* Megatron tensor of one rank, and
back from the TP-gathered Megatron tensor:

- ``copy``: the same tensor; TP shards (if any) split along the parameter's ``partition_dim``.
- ``qkv``: q, k, v interleaved per query group ``[q_g; k_g; v_g]`` for g = 0..groups-1, so TP
  ranks own whole groups.
- ``gate_up``: SwiGLU ``linear_fc1``; each TP shard is ``[gate_r; up_r]``.
- ``vocab``: rows padded to Megatron's padded vocabulary; padding rows are zero and trimmed on export.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch

COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str
    """Canonical Megatron name with ``{layer}`` / ``{expert}`` placeholders."""
    hf: tuple[str, ...]
    """HF names with the same placeholders, in the transform's order (q,k,v / gate,up)."""
    transform: str = COPY


def _dense_rules(attn: str = "self_attn", mlp: str = "mlp") -> list[Rule]:
    layer = "decoder.layers.{layer}"
    hf_layer = "model.layers.{layer}"
    return [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
        Rule(f"{layer}.input_layernorm.weight", (f"{hf_layer}.input_layernorm.weight",)),
        Rule(f"{layer}.self_attention.linear_qkv.weight",
             tuple(f"{hf_layer}.{attn}.{p}_proj.weight" for p in "qkv"), QKV),
        Rule(f"{layer}.self_attention.linear_qkv.bias",
             tuple(f"{hf_layer}.{attn}.{p}_proj.bias" for p in "qkv"), QKV),
        Rule(f"{layer}.self_attention.q_layernorm.weight", (f"{hf_layer}.{attn}.q_norm.weight",)),
        Rule(f"{layer}.self_attention.k_layernorm.weight", (f"{hf_layer}.{attn}.k_norm.weight",)),
        Rule(f"{layer}.self_attention.linear_proj.weight", (f"{hf_layer}.{attn}.o_proj.weight",)),
        Rule(f"{layer}.pre_mlp_layernorm.weight", (f"{hf_layer}.post_attention_layernorm.weight",)),
        Rule(f"{layer}.mlp.linear_fc1.weight",
             (f"{hf_layer}.{mlp}.gate_proj.weight", f"{hf_layer}.{mlp}.up_proj.weight"), GATE_UP),
        Rule(f"{layer}.mlp.linear_fc2.weight", (f"{hf_layer}.{mlp}.down_proj.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("output_layer.weight", ("lm_head.weight",), VOCAB),
    ]


def _vision_language_rules(rules: list[Rule]) -> list[Rule]:
    """Qwen2.5-VL as its checkpoints store it (and transformers saves it): the language model's tensors under the
    text model's names, and the vision tower's under ``visual.``, copied whole (every rank of the first stage holds
    the tower, see ``rlmega.models.vision_language``)."""
    return rules + [Rule("visual.{name}", ("visual.{name}",))]


def _score_rules(rules: list[Rule]) -> list[Rule]:
    """A ``*ForSequenceClassification`` checkpoint (reward model): the trunk's rules, and HF's
    ``score`` head ``[num_labels, hidden]`` as the output layer, copied whole (every TP rank holds it,
    see ``rlmega.models.reward_head``; no vocabulary, so no padding)."""
    return [rule for rule in rules if rule.megatron != "output_layer.weight"] + [
        Rule("output_layer.weight", ("score.weight",)),
    ]


def _expert_rules(moe: str, router: str, gate: str, up: str, down: str) -> list[Rule]:
    layer = "decoder.layers.{layer}.mlp"
    hf = "model.layers.{layer}." + moe
    expert = f"{layer}.experts.local_experts.{{expert}}"
    return [
        Rule(f"{layer}.router.weight", (f"{hf}.{router}.weight",)),
        Rule(f"{expert}.linear_fc1.weight",
             (f"{hf}.experts.{{expert}}.{gate}.weight", f"{hf}.experts.{{expert}}.{up}.weight"), GATE_UP),
        Rule(f"{expert}.linear_fc2.weight", (f"{hf}.experts.{{expert}}.{down}.weight",)),
    ]


def _mtp_rules(layer_rules: list[Rule]) -> list[Rule]:
    """DeepSeek-V3 multi-token prediction, MTP layer k named by its global index num_layers + k
    (``rlmega.bridge.params``), which is also HF's: a full decoder layer (``layer_rules``, moved
    into the MTP layer's transformer_layer) plus the MTP norms and projection.

    HF's MTP layer also stores copies of the embedding and LM head; Megatron's MTP shares the main
    model's, and ``params`` names them ``embed_tokens`` / ``shared_head.head`` so they are exported
    under HF's names too.
    """
    mtp, hf = "mtp.layers.{layer}", "model.layers.{layer}"
    decoder_layer = "decoder.layers.{layer}."
    return [
        dataclasses.replace(rule, megatron=f"{mtp}.transformer_layer.{rule.megatron[len(decoder_layer):]}")
        for rule in layer_rules if rule.megatron.startswith(decoder_layer)
    ] + [
        Rule(f"{mtp}.enorm.weight", (f"{hf}.enorm.weight",)),
        Rule(f"{mtp}.hnorm.weight", (f"{hf}.hnorm.weight",)),
        # Both concatenate [embedding; hidden states] before the projection.
        Rule(f"{mtp}.eh_proj.weight", (f"{hf}.eh_proj.weight",)),
        Rule(f"{mtp}.final_layernorm.weight", (f"{hf}.shared_head.norm.weight",)),
        Rule(f"{mtp}.embed_tokens.weight", (f"{hf}.embed_tokens.weight",), VOCAB),
        Rule(f"{mtp}.shared_head.head.weight", (f"{hf}.shared_head.head.weight",), VOCAB),
    ]


def _deepseek_v3_rules() -> list[Rule]:
    """Multi-Latent Attention, dense first layers, routed + shared experts, router score bias, MTP.

    HF's per-head [nope; rope] rows (q_b_proj / q_proj) and [nope; v] rows (kv_b_proj), and its
    [kv latent; rope] rows (kv_a_proj_with_mqa), are laid out as Megatron's: plain copies. The
    rope dims stay in HF's interleaved-pair order, which Megatron's MLA RoPE reads as such.
    """
    layer = "decoder.layers.{layer}"
    attn = f"{layer}.self_attention"
    hf_attn = "model.layers.{layer}.self_attn"
    hf_moe = "model.layers.{layer}.mlp"
    shared = f"{layer}.mlp.shared_experts"
    not_attention = [rule for rule in _dense_rules() if ".self_attention." not in rule.megatron]
    rules = not_attention + [
        Rule(f"{attn}.linear_q_proj.weight", (f"{hf_attn}.q_proj.weight",)),
        Rule(f"{attn}.linear_q_down_proj.weight", (f"{hf_attn}.q_a_proj.weight",)),
        Rule(f"{attn}.q_layernorm.weight", (f"{hf_attn}.q_a_layernorm.weight",)),
        Rule(f"{attn}.linear_q_up_proj.weight", (f"{hf_attn}.q_b_proj.weight",)),
        Rule(f"{attn}.linear_kv_down_proj.weight", (f"{hf_attn}.kv_a_proj_with_mqa.weight",)),
        Rule(f"{attn}.kv_layernorm.weight", (f"{hf_attn}.kv_a_layernorm.weight",)),
        Rule(f"{attn}.linear_kv_up_proj.weight", (f"{hf_attn}.kv_b_proj.weight",)),
        Rule(f"{attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",)),
        Rule(f"{layer}.mlp.router.expert_bias", (f"{hf_moe}.gate.e_score_correction_bias",)),
        Rule(f"{shared}.linear_fc1.weight",
             (f"{hf_moe}.shared_experts.gate_proj.weight", f"{hf_moe}.shared_experts.up_proj.weight"), GATE_UP),
        Rule(f"{shared}.linear_fc2.weight", (f"{hf_moe}.shared_experts.down_proj.weight",)),
    ] + _expert_rules("mlp", "gate", "gate_proj", "up_proj", "down_proj")
    return rules + _mtp_rules(rules)


RULES: dict[str, list[Rule]] = {
    "LlamaForCausalLM": _dense_rules(),
    "Qwen2ForCausalLM": _dense_rules(),
    "Qwen3ForCausalLM": _dense_rules(),
    "Qwen3MoeForCausalLM": _dense_rules() + _expert_rules("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": _dense_rules() + _expert_rules("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "DeepseekV3ForCausalLM": _deepseek_v3_rules(),
    "Qwen2_5_VLForConditionalGeneration": _vision_language_rules(_dense_rules()),
    "LlamaForSequenceClassification": _score_rules(_dense_rules()),
    "Qwen2ForSequenceClassification": _score_rules(_dense_rules()),
    "Qwen3ForSequenceClassification": _score_rules(_dense_rules()),
}

# The TE layer spec fuses the pre-attention and pre-MLP norms (and MLA's latent norms) into the
# following linear layer.
_TE_NAMES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}


def canonical_te_name(name: str) -> str:
    for te, local in _TE_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    escaped = escaped.replace(r"\{name\}", r"(?P<name>.+)")  # any name below a prefix (a module held whole)
    return re.compile(f"^{escaped}$")


class RuleBook:
    """Finds the rule for a canonical Megatron name and fills in its HF names."""

    def __init__(self, architecture: str):
        if architecture not in RULES:
            raise ValueError(f"no weight mapping for {architecture}; supported: {', '.join(RULES)}")
        self.rules = [(_pattern(rule.megatron), rule) for rule in RULES[architecture]]

    def resolve(self, canonical_name: str) -> tuple[Rule, tuple[str, ...]]:
        for pattern, rule in self.rules:
            match = pattern.match(canonical_name)
            if match:
                return rule, tuple(name.format(**match.groupdict()) for name in rule.hf)
        raise KeyError(f"no HF mapping for Megatron parameter {canonical_name!r}")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Model dimensions the qkv and vocab transforms need."""

    num_query_groups: int
    heads_per_group: int
    head_dim: int
    vocab_size: int


def to_hf(rule: Rule, gathered: torch.Tensor, hf_names: tuple[str, ...], geometry: Geometry, tp: int) -> dict[str, torch.Tensor]:
    """The HF tensors of a TP-gathered Megatron tensor (``tp``: the shard count it was gathered from)."""
    if rule.transform == COPY:
        return {hf_names[0]: gathered}
    if rule.transform == VOCAB:
        return {hf_names[0]: gathered[: geometry.vocab_size]}
    if rule.transform == QKV:
        g = geometry
        grouped = gathered.reshape(g.num_query_groups, (g.heads_per_group + 2) * g.head_dim, *gathered.shape[1:])
        q, k, v = grouped.split([g.heads_per_group * g.head_dim, g.head_dim, g.head_dim], dim=1)
        return {name: t.reshape(-1, *gathered.shape[1:]) for name, t in zip(hf_names, (q, k, v))}
    if rule.transform == GATE_UP:
        shards = gathered.chunk(tp, dim=0)
        gate = torch.cat([s.chunk(2, dim=0)[0] for s in shards])
        up = torch.cat([s.chunk(2, dim=0)[1] for s in shards])
        return {hf_names[0]: gate, hf_names[1]: up}
    raise ValueError(f"unknown transform {rule.transform!r}")


def hf_shapes(rule: Rule, gathered_shape: torch.Size, geometry: Geometry) -> list[tuple[int, ...]]:
    """Full shapes the HF tensors of a rule must have, given the gathered Megatron shape."""
    rest = tuple(gathered_shape[1:])
    if rule.transform == COPY:
        return [tuple(gathered_shape)]
    if rule.transform == VOCAB:
        return [(geometry.vocab_size, *rest)]
    if rule.transform == QKV:
        g = geometry
        return [(g.num_query_groups * g.heads_per_group * g.head_dim, *rest)] + [(g.num_query_groups * g.head_dim, *rest)] * 2
    if rule.transform == GATE_UP:
        return [(gathered_shape[0] // 2, *rest)] * 2
    raise ValueError(f"unknown transform {rule.transform!r}")


def shard_from_hf(rule: Rule, read, hf_names: tuple[str, ...], local_shape: torch.Size,
                  partition_dim: Optional[int], tp_rank: int, tp: int, geometry: Geometry) -> torch.Tensor:
    """This TP rank's Megatron shard, reading only the HF rows/columns it needs.

    ``read(name, rows, cols)`` returns a slice of an HF tensor (None: the whole dimension).
    """
    sharded = partition_dim is not None and tp > 1

    def own(length: int) -> slice:
        size = length // tp
        return slice(tp_rank * size, (tp_rank + 1) * size)

    if rule.transform == COPY:
        if not sharded:
            return read(hf_names[0], None, None)
        if partition_dim == 0:
            return read(hf_names[0], own(local_shape[0] * tp), None)
        return read(hf_names[0], None, own(local_shape[1] * tp))
    if rule.transform == VOCAB:
        rows = own(local_shape[0] * tp) if sharded else slice(0, local_shape[0])
        stop = min(rows.stop, geometry.vocab_size)
        shard = torch.zeros(local_shape, dtype=torch.float32)
        if stop > rows.start:
            part = read(hf_names[0], slice(rows.start, stop), None)
            shard = shard.to(part.dtype)
            shard[: stop - rows.start] = part
        return shard
    if rule.transform == QKV:
        g = geometry
        groups = slice(0, g.num_query_groups)
        if sharded:
            per_rank = g.num_query_groups // tp
            groups = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        q_rows = slice(groups.start * g.heads_per_group * g.head_dim, groups.stop * g.heads_per_group * g.head_dim)
        kv_rows = slice(groups.start * g.head_dim, groups.stop * g.head_dim)
        q, k, v = read(hf_names[0], q_rows, None), read(hf_names[1], kv_rows, None), read(hf_names[2], kv_rows, None)
        count = groups.stop - groups.start
        parts = [t.reshape(count, -1, *t.shape[1:]) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])
    if rule.transform == GATE_UP:
        rows = own(local_shape[0] * tp // 2) if sharded else None
        return torch.cat([read(hf_names[0], rows, None), read(hf_names[1], rows, None)])
    raise ValueError(f"unknown transform {rule.transform!r}")

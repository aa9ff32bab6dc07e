"""Where each HF tensor lies across the trainer's ranks, worked out from the model's config and the parallel layout
alone: the same ``Piece`` list ``rlmega.bridge.pieces.piece_layout`` reads off a built model, with no model, no
process group and no collective (a DeepSeek-V3 layout of 256 ranks in about a second).

It follows what the built model does, step by step:

- each pipeline stage (and virtual stage) holds the layers Megatron gives it (``ParallelLayout``: even stages,
  uneven first/last stages, interleaved chunks), the first the embedding, the last the final norm, the LM head
  (unless tied) and the MTP layers;
- each Megatron parameter, with its gathered shape and tensor-parallel split, in the order the layer modules
  register them (Megatron's local layer spec; the transformer-engine spec keeps the same parameters and splits,
  except that it holds MLA's down-projections whole on every TP rank, and orders a layer's fused norms
  differently);
- the bridge's own rules (``mapping.RuleBook``, ``mapping.hf_shapes``) turn each into its HF tensors;
- the owners are the TP group (experts: ETP group) of data-parallel replica 0 of the stage; Megatron orders a
  stage's ranks tp-cp-dp for dense layers and etp-ep-edp for experts (``rlmega.plan.meta_build.StageCoordinates``);
- the order is the announcement's: ranks in turn, each its parameters, weight buffers and MTP copies per chunk,
  then ``pieces.in_layer_order``.

Besides the owners, each piece's replicas: the same positions in the other data-parallel (with context-parallel)
replicas, or, for an expert, the other expert-data-parallel replicas; they hold identical copies.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Union

import torch

from rlmega.bridge.mapping import QKV, VOCAB, RuleBook, hf_shapes
from rlmega.bridge.params import geometry_of
from rlmega.bridge.pieces import Piece, _Unit, in_layer_order
from rlmega.models.spec import ModelSpec, has_transformer_engine, padded_vocab_size
from rlmega.parallel.layout import ParallelLayout

_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                  "MixtralForCausalLM", "DeepseekV3ForCausalLM")


@dataclasses.dataclass(frozen=True)
class PlacedPiece:
    """A piece, and every set of ranks that holds an identical copy of it."""

    piece: Piece
    replicas: tuple[tuple[int, ...], ...]
    """Owner tuples, one per data-parallel (expert: expert-data-parallel) replica, replica 0 (``piece.owners``)
    first; position i of each holds what owner i holds."""
    expert: bool


@dataclasses.dataclass(frozen=True)
class _Param:
    canonical: str
    shape: tuple[int, ...]
    """Gathered over TP (experts: ETP), the vocabulary padded."""
    partition_dim: Optional[int]
    expert: bool = False


def _norm(name: str, size: int) -> _Param:
    return _Param(name, (size,), None)


def _attention(config: dict, prefix: str, te: bool) -> Iterator[_Param]:
    """A layer's attention parameters in the order its modules register them."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    attn = f"{prefix}.self_attention"
    if config.get("multi_latent_attention"):
        nope, rope, v_dim = config["qk_head_dim"], config["qk_pos_emb_head_dim"], config["v_head_dim"]
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        down = None if te else 0  # transformer-engine's down-projections are whole on every TP rank
        yield _Param(f"{attn}.linear_proj.weight", (hidden, heads * v_dim), 1)
        if q_rank is None:
            yield _Param(f"{attn}.linear_q_proj.weight", (heads * (nope + rope), hidden), 0)
        else:
            yield _Param(f"{attn}.linear_q_down_proj.weight", (q_rank, hidden), down)
            yield _Param(f"{attn}.linear_q_up_proj.weight", (heads * (nope + rope), q_rank), 0)
        yield _Param(f"{attn}.linear_kv_down_proj.weight", (kv_rank + rope, hidden), down)
        yield _Param(f"{attn}.linear_kv_up_proj.weight", (heads * (nope + v_dim), kv_rank), 0)
        if q_rank is not None:
            yield _norm(f"{attn}.q_layernorm.weight", q_rank)
        yield _norm(f"{attn}.kv_layernorm.weight", kv_rank)
        return
    groups = config.get("num_query_groups") or heads
    head_dim = config.get("kv_channels") or hidden // heads
    yield _Param(f"{attn}.linear_proj.weight", (hidden, heads * head_dim), 1)
    yield _Param(f"{attn}.linear_qkv.weight", ((heads + 2 * groups) * head_dim, hidden), 0)
    if config.get("add_qkv_bias"):
        yield _Param(f"{attn}.linear_qkv.bias", ((heads + 2 * groups) * head_dim,), 0)
    if config.get("qk_layernorm"):
        yield _norm(f"{attn}.q_layernorm.weight", head_dim)
        yield _norm(f"{attn}.k_layernorm.weight", head_dim)


def _mlp(prefix: str, hidden: int, ffn: int, expert: bool = False) -> Iterator[_Param]:
    yield _Param(f"{prefix}.linear_fc1.weight", (2 * ffn, hidden), 0, expert)
    yield _Param(f"{prefix}.linear_fc2.weight", (hidden, ffn), 1, expert)


def _layer(config: dict, prefix: str, moe: bool, te: bool) -> Iterator[_Param]:
    """A transformer layer's parameters in module order (norm, attention, norm, MLP: router, experts, shared)."""
    hidden = config["hidden_size"]
    yield _norm(f"{prefix}.input_layernorm.weight", hidden)
    yield from _attention(config, prefix, te)
    yield _norm(f"{prefix}.pre_mlp_layernorm.weight", hidden)
    if not moe:
        yield from _mlp(f"{prefix}.mlp", hidden, config["ffn_hidden_size"])
        return
    experts = config["num_moe_experts"]
    yield _Param(f"{prefix}.mlp.router.weight", (experts, hidden), None)
    for expert in range(experts):
        yield from _mlp(f"{prefix}.mlp.experts.local_experts.{expert}", hidden, config["moe_ffn_hidden_size"], True)
    if config.get("moe_shared_expert_intermediate_size"):
        yield from _mlp(f"{prefix}.mlp.shared_experts", hidden, config["moe_shared_expert_intermediate_size"])


def _is_moe(spec: ModelSpec, layer: int) -> bool:
    pattern = spec.config.get("moe_layer_freq")
    return bool(pattern[layer]) if isinstance(pattern, list) else spec.num_experts is not None


def stage_layers(layout: ParallelLayout, num_layers: int) -> list[list[range]]:
    """Per pipeline stage, per virtual stage, the global indices of the layers it holds (Megatron's split:
    interleaved chunks of ``num_layers / (pp x vpp)``, or uneven first/last stages and even ones between)."""
    pp, vpp = layout.pp, layout.virtual_stages
    if not layout.uneven_stages:
        size = num_layers // (pp * vpp)
        return [[range((v * pp + p) * size, (v * pp + p + 1) * size) for v in range(vpp)] for p in range(pp)]
    first, last = layout.first_stage_layers, layout.last_stage_layers
    middle_stages = pp - (first is not None) - (last is not None)
    middle = (num_layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    starts = [sum(counts[:p]) for p in range(pp)]
    return [[range(starts[p], starts[p] + counts[p])] for p in range(pp)]


def _chunk(spec: ModelSpec, layout: ParallelLayout, layers: range, first: bool, last: bool,
           te: bool) -> Iterator[_Param]:
    """One model chunk's parameters, weight buffers, then the MTP layers' names of the shared embedding and LM
    head: ``rlmega.bridge.params.local_params``'s order, tied copies left out as the export leaves them."""
    config, hidden = spec.config, spec.config["hidden_size"]
    vocab = (padded_vocab_size(spec.vocab_size, layout.tp), hidden)
    if first:
        yield _Param("embedding.word_embeddings.weight", vocab, 0)
    for layer in layers:
        yield from _layer(config, f"decoder.layers.{layer}", _is_moe(spec, layer), te)
    mtp = range(spec.num_layers, spec.num_layers + spec.mtp_num_layers) if last else range(0)
    if last:
        yield _norm("decoder.final_layernorm.weight", hidden)
        for index in mtp:
            prefix = f"mtp.layers.{index}"
            yield _norm(f"{prefix}.enorm.weight", hidden)
            yield _norm(f"{prefix}.hnorm.weight", hidden)
            yield _Param(f"{prefix}.eh_proj.weight", (hidden, 2 * hidden), 0)
            # Megatron builds each MTP layer's transformer layer like the model's last layer.
            yield from _layer(config, f"{prefix}.transformer_layer", _is_moe(spec, spec.num_layers - 1), te)
            yield _norm(f"{prefix}.final_layernorm.weight", hidden)
        if not spec.tie_word_embeddings:
            yield _Param("output_layer.weight", vocab, 0)
    if config.get("moe_router_enable_expert_bias"):  # the routers' score bias: module buffers, after the parameters
        for layer in layers:
            if _is_moe(spec, layer):
                yield _Param(f"decoder.layers.{layer}.mlp.router.expert_bias", (config["num_moe_experts"],), None)
        for index in mtp:
            if _is_moe(spec, spec.num_layers - 1):
                yield _Param(f"mtp.layers.{index}.transformer_layer.mlp.router.expert_bias",
                             (config["num_moe_experts"],), None)
    for index in mtp:
        yield _Param(f"mtp.layers.{index}.embed_tokens.weight", vocab, 0)
        yield _Param(f"mtp.layers.{index}.shared_head.head.weight", vocab, 0)


def _expert_index(canonical: str) -> int:
    parts = canonical.split(".")
    return int(parts[parts.index("local_experts") + 1])


def _spec_of(model: Union[ModelSpec, dict, str]) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from rlmega.models import model_spec_from_hf

    return model_spec_from_hf(model)


def placed_pieces(model: Union[ModelSpec, dict, str], layout: ParallelLayout, *, dtype: torch.dtype = torch.bfloat16,
                  transformer_engine: Optional[bool] = None) -> list[PlacedPiece]:
    """Every HF tensor of the model with its owners (as ``piece_layout`` gives them) and replicas.

    ``model``: a ``ModelSpec``, or an HF config (dict, ``config.json`` or checkpoint directory). ``dtype``: the
    training weights' (bf16 on a GPU run). ``transformer_engine``: which layer spec builds the layers (None: the one
    ``ModelSpec.layer_spec`` picks here, transformer-engine where it is installed)."""
    spec = _spec_of(model)
    if spec.architecture not in _ARCHITECTURES or spec.vision is not None or spec.score_head is not None:
        raise ValueError(f"no analytic piece layout for {spec.architecture}; supported: {', '.join(_ARCHITECTURES)}")
    spec.check_layout(layout)
    te = has_transformer_engine() if transformer_engine is None else transformer_engine
    book, geometry = RuleBook(spec.architecture), geometry_of(spec)
    per_stage = layout.world_size // layout.pp
    etp, ep = layout.expert_tp, layout.ep
    experts_per_rank = (spec.num_experts or ep) // ep
    units, expert_of = [], {}
    for stage, chunks in enumerate(stage_layers(layout, spec.num_layers)):
        base = stage * per_stage
        announced: dict[int, list] = {}  # rank -> its units, in its chunks' order
        for vp, layers in enumerate(chunks):
            first = stage == 0 and vp == 0
            last = stage == layout.pp - 1 and vp == len(chunks) - 1
            for param in _chunk(spec, layout, layers, first, last, te):
                group = etp if param.expert else layout.tp
                announcer = base + (_expert_index(param.canonical) // experts_per_rank) * etp if param.expert else base
                owners = tuple(range(announcer, announcer + group))
                split_dim = None
                rule, names = book.resolve(param.canonical)
                if param.partition_dim is not None and group > 1:
                    split_dim = 0 if rule.transform in (QKV, VOCAB) or len(names) > 1 else param.partition_dim
                shapes = hf_shapes(rule, torch.Size(param.shape), geometry)
                pieces = tuple(Piece(name, dtype, tuple(shape), owners, split_dim)
                               for name, shape in zip(names, shapes))
                unit = _Unit(param.canonical, pieces)
                expert_of[param.canonical] = param.expert
                announced.setdefault(announcer, []).append(unit)
        units += [unit for rank in sorted(announced) for unit in announced[rank]]
    # Across stages the announcement is rank-major too: stage by stage, as the ranks are numbered.
    placed = []
    for unit in in_layer_order(units):
        expert = expert_of[unit.canonical]
        for piece in unit.pieces:
            placed.append(PlacedPiece(piece, replicas_of(piece.owners, layout, expert=expert), expert))
    return placed


def layout_pieces(model: Union[ModelSpec, dict, str], layout: ParallelLayout, *, dtype: torch.dtype = torch.bfloat16,
                  transformer_engine: Optional[bool] = None) -> list[Piece]:
    """``piece_layout`` of the model built in ``layout``, without building it (see ``placed_pieces``)."""
    return [placed.piece for placed in placed_pieces(model, layout, dtype=dtype, transformer_engine=transformer_engine)]


def replicas_of(owners: tuple[int, ...], layout: ParallelLayout, *, expert: bool) -> tuple[tuple[int, ...], ...]:
    """The owner tuples of every replica of a piece owned by ``owners`` (data-parallel replica 0), replica 0
    first: dense pieces repeat every ``tp`` ranks of a stage (tp-cp-dp order), experts every ``etp x ep``
    (etp-ep-edp order)."""
    if expert:
        stride, count = layout.expert_tp * layout.ep, layout.expert_dp
    else:
        stride, count = layout.tp, layout.cp * layout.dp
    return tuple(tuple(owner + replica * stride for owner in owners) for replica in range(count))

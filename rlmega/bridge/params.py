"""This rank's Megatron parameters under canonical names, with how they are tensor-parallel split.

Canonical names use global layer and expert indices. Multi-token-prediction (MTP) layer k is named
``mtp.layers.{num_layers + k}``, its transformer layer ``transformer_layer`` on every megatron-core release
(``rlmega.models.mtp_model``): Megatron 0.16 numbers that layer after the decoder's (its ``layer_number - 1``
is ``num_layers + k``) and HF stores it as ``model.layers.{num_layers + k}``, so the index is the same in all
three and never collides with a decoder layer's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Optional

import torch

from rlmega.bridge.mapping import Geometry, canonical_te_name
from rlmega.models import mtp_model
from rlmega.models.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_EXPERT_BIAS = ".mlp.router.expert_bias"
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT_LAYER = "output_layer.weight"


@dataclasses.dataclass
class LocalParam:
    canonical: str
    """Name with global layer and expert indices, local-spec naming."""
    tensor: torch.Tensor
    partition_dim: Optional[int]
    """Dimension split over tensor-parallel ranks, or None when every TP rank holds it whole."""
    is_expert: bool
    """Split over the expert-tensor-parallel group rather than the tensor-parallel group."""
    tied_output: bool = False
    """A later pipeline stage's copy of the input embedding: the tied output layer
    (``output_layer.weight`` with pp > 1) or the MTP stage's embedding. Loaded from the embedding's
    HF tensor, never exported (the first stage exports the embedding)."""
    copy_of: Optional[str] = None
    """Set on a second name of a parameter (DeepSeek's MTP ``embed_tokens`` / ``shared_head.head``,
    which are Megatron's shared embedding / output layer): the canonical name of that parameter.
    Exported under both names; on load, the HF copy must equal the parameter's HF tensor."""


class AdaptedParam(LocalParam):
    """A base weight with a LoRA adapter (``rlmega.models.lora``): ``tensor`` reads give the weight the model
    computes with, merged on each read (``W + scale * B @ A`` of this TP shard, so export and weight sync send merged
    weights through every path), or the base parameter itself while the adapters are off (a load writes into it)."""

    @property
    def tensor(self) -> torch.Tensor:
        return self._base.lora_adapter.effective_weight(self._base)

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:
        self._base = value


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _partition_dim(param: torch.Tensor) -> Optional[int]:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _global_expert(transformer_layer: torch.nn.Module, rest: str) -> str:
    """``rest`` (a name inside a layer) with its local expert index made global."""
    expert = _EXPERT.match(rest)
    if not expert:
        return rest
    global_expert = transformer_layer.mlp.local_expert_indices[int(expert.group(1))]
    return f"mlp.experts.local_experts.{global_expert}.{expert.group(2)}"


def _canonical(model: torch.nn.Module, name: str) -> str:
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        return canonical_te_name(f"decoder.layers.{layer.layer_number - 1}.{_global_expert(layer, match.group(2))}")
    match = _MTP_LAYER.match(name)
    if match:
        mtp_layer = model.mtp.layers[int(match.group(1))]
        inner = getattr(mtp_layer, mtp_model.inner_layer_attribute())
        rest = mtp_model.canonical_inner_name(match.group(2))
        prefix = mtp_model.CANONICAL_INNER_LAYER + "."
        if rest.startswith(prefix):
            rest = prefix + _global_expert(inner, rest[len(prefix):])
        return canonical_te_name(f"mtp.layers.{mtp_model.canonical_layer_index(model, mtp_layer)}.{rest}")
    return canonical_te_name(name)


def _mtp_shared_params(model: torch.nn.Module) -> Iterator[LocalParam]:
    """Each MTP layer's names for the embedding and output layer it shares with the main model."""
    if getattr(model, "mtp", None) is None:
        return
    embedding, output = model.embedding.word_embeddings.weight, model.output_layer.weight
    for mtp_layer in model.mtp.layers:
        prefix = f"mtp.layers.{mtp_model.canonical_layer_index(model, mtp_layer)}"
        for suffix, tensor, owner in (("embed_tokens.weight", embedding, _EMBEDDING),
                                      ("shared_head.head.weight", output, _OUTPUT_LAYER)):
            yield LocalParam(canonical=f"{prefix}.{suffix}", tensor=tensor, partition_dim=_partition_dim(tensor),
                             is_expert=False, copy_of=owner)


def _checkpoint_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that are model weights: the routers' expert score bias (HF's e_score_correction_bias)."""
    for name, buffer in model.named_buffers():
        if name.endswith(_EXPERT_BIAS):
            yield name, buffer


def local_params(chunks: list) -> Iterator[LocalParam]:
    """Per chunk, in a deterministic order: every parameter, the weight buffers, then the second
    names of shared parameters (``copy_of``), after the parameters they name."""
    for chunk in chunks:
        model = unwrap(chunk)
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        for name, param in model.named_parameters():
            if getattr(param, "is_value_head", False) or getattr(param, "is_lora_adapter", False):
                continue  # a critic's scalar head, a LoRA adapter (merged into its base weight): no HF counterpart
            kind = AdaptedParam if hasattr(param, "lora_adapter") else LocalParam
            yield kind(
                canonical=_canonical(model, name),
                tensor=param,
                partition_dim=_partition_dim(param),
                is_expert=not getattr(param, "allreduce", True),
                tied_output=(tied and name == _OUTPUT_LAYER) or (name == _EMBEDDING and not model.pre_process),
            )
        for name, buffer in _checkpoint_buffers(model):  # replicated on every TP and EP rank
            yield LocalParam(canonical=_canonical(model, name), tensor=buffer, partition_dim=None, is_expert=False)
        yield from _mtp_shared_params(model)


def tp_group_of(param: LocalParam):
    """(group, rank in it, size) that splits ``param``."""
    from megatron.core import parallel_state as ps

    if param.is_expert:
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def geometry_of(spec: ModelSpec) -> Geometry:
    groups = spec.config.get("num_query_groups") or spec.config["num_attention_heads"]
    return Geometry(
        num_query_groups=groups,
        heads_per_group=spec.config["num_attention_heads"] // groups,
        head_dim=spec.config.get("kv_channels") or spec.config["hidden_size"] // spec.config["num_attention_heads"],
        vocab_size=spec.vocab_size,
    )


def gathered_shape(param: LocalParam, tp: int) -> torch.Size:
    shape = list(param.tensor.shape)
    if param.partition_dim is not None:
        shape[param.partition_dim] *= tp
    return torch.Size(shape)

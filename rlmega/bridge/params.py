"""This rank's Megatron parameters under canonical names, with how they are tensor-parallel split."""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Optional

import torch

from rlmega.bridge.mapping import Geometry, canonical_te_name
from rlmega.models.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_EXPERT_BIAS = ".mlp.router.expert_bias"


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
    """The last stage's copy of tied input embeddings (``output_layer.weight`` with pp > 1)."""


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _canonical(model: torch.nn.Module, name: str) -> str:
    match = _LAYER.match(name)
    if not match:
        return canonical_te_name(name)
    local_index, rest = int(match.group(1)), match.group(2)
    layer = model.decoder.layers[local_index]
    expert = _EXPERT.match(rest)
    if expert:
        global_expert = layer.mlp.local_expert_indices[int(expert.group(1))]
        rest = f"mlp.experts.local_experts.{global_expert}.{expert.group(2)}"
    return canonical_te_name(f"decoder.layers.{layer.layer_number - 1}.{rest}")


def _checkpoint_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that are model weights: the routers' expert score bias (HF's e_score_correction_bias)."""
    for name, buffer in model.named_buffers():
        if name.endswith(_EXPERT_BIAS):
            yield name, buffer


def local_params(chunks: list) -> Iterator[LocalParam]:
    """Every parameter of this rank's model chunks, then its weight buffers, in a deterministic order."""
    for chunk in chunks:
        model = unwrap(chunk)
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        for name, param in model.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            yield LocalParam(
                canonical=_canonical(model, name),
                tensor=param,
                partition_dim=param.partition_dim if split else None,
                is_expert=not getattr(param, "allreduce", True),
                tied_output=tied and name == "output_layer.weight",
            )
        for name, buffer in _checkpoint_buffers(model):  # replicated on every TP and EP rank
            yield LocalParam(canonical=_canonical(model, name), tensor=buffer, partition_dim=None, is_expert=False)


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

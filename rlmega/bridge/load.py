"""HF safetensors -> a sharded Megatron model; each rank reads only its own slices."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rlmega.bridge.hf_checkpoint import CheckpointError, HFCheckpoint
from rlmega.bridge.mapping import RuleBook, hf_shapes, shard_from_hf
from rlmega.bridge.params import gathered_shape, geometry_of, local_params, tp_group_of
from rlmega.models.spec import ModelSpec

_LM_HEAD = "lm_head.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def _plan(chunks: list, spec: ModelSpec):
    """[(param, rule, hf names, tp rank, tp size, owner's hf name)] for this rank, and
    {hf name: full shape} it needs. The owner's name is set for a ``copy_of`` param only."""
    book, geometry = RuleBook(spec.architecture), geometry_of(spec)
    plan, needed = [], {}
    for param in local_params(chunks):
        rule, names = book.resolve(param.canonical)
        if param.tied_output:
            names = book.resolve(_EMBEDDING)[1]
        owner = book.resolve(param.copy_of)[1][0] if param.copy_of is not None else None
        _, tp_rank, tp = tp_group_of(param)
        for name, shape in zip(names, hf_shapes(rule, gathered_shape(param, tp), geometry)):
            needed[name] = shape
        plan.append((param, rule, names, tp_rank, tp, owner))
    return plan, needed


def _all_needed(needed: dict) -> dict:
    """The union over ranks: every rank then checks the whole model and fails the same way."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return needed
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, needed)
    union = {}
    for part in gathered:
        union.update(part)
    return union


def check_checkpoint(checkpoint: HFCheckpoint, needed: dict[str, tuple], tied: bool, unused: frozenset = frozenset(),
                     embedding: str = "model.embed_tokens.weight") -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor (``unused``
    names may be present without being needed; ``embedding``: the HF name of the input embedding)."""
    present = checkpoint.keys() - unused
    for name in sorted(needed):
        if name not in present:
            raise CheckpointError(f"checkpoint {checkpoint.directory} is missing {name!r}, which the model config needs")
    if tied:
        check_tied_head(checkpoint, embedding)
    unexpected = sorted(present - set(needed) - ({_LM_HEAD} if tied else set()))
    if unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} has {unexpected[0]!r}, which the model config does not use "
            f"({len(unexpected)} unexpected tensor(s)); is config.json the one these weights were saved with?"
        )
    for name in sorted(needed):
        if checkpoint.shape(name) != tuple(needed[name]):
            raise CheckpointError(
                f"{name!r} has shape {list(checkpoint.shape(name))} in {checkpoint.directory}, "
                f"but the model config implies {list(needed[name])}"
            )


def check_tied_head(checkpoint: HFCheckpoint, embedding: str = "model.embed_tokens.weight") -> bool:
    """A config that ties the LM head to the embedding may still come with a stored copy of the
    head; one that differs from the embedding would be dropped without a word, so refuse it.
    True when the checkpoint stores a head equal to the embedding."""
    if _LM_HEAD not in checkpoint.keys() or embedding not in checkpoint.keys():
        return False
    if checkpoint.shape(_LM_HEAD) == checkpoint.shape(embedding) and torch.equal(
            checkpoint.read(_LM_HEAD), checkpoint.read(embedding)):
        return True
    raise CheckpointError(
        f"checkpoint {checkpoint.directory} holds its own {_LM_HEAD!r}, different from {embedding!r}, but its "
        "config.json sets tie_word_embeddings: true, so the head would be dropped; set \"tie_word_embeddings\": false "
        f"in config.json to keep the head, or delete {_LM_HEAD!r} from the checkpoint to use the embedding as the head"
    )


@torch.no_grad()
def load_hf_weights(chunks: list, spec: ModelSpec, directory: str | Path, *, without_lm_head: bool = False) -> None:
    """Fill this rank's Megatron chunks from an HF checkpoint directory (collective over all ranks).

    ``without_lm_head``: the model has no LM head (a critic's value head replaces it), so the
    checkpoint's ``lm_head.weight`` is not used.
    """
    checkpoint = HFCheckpoint(directory)
    plan, needed = _plan(chunks, spec)
    unused = frozenset({_LM_HEAD}) if without_lm_head else frozenset()
    if spec.unused_hf_prefixes:
        unused |= {name for name in checkpoint.keys() if name.startswith(spec.unused_hf_prefixes)}
    check_checkpoint(checkpoint, _all_needed(needed), spec.tie_word_embeddings, unused,
                     RuleBook(spec.architecture).resolve(_EMBEDDING)[1][0])
    geometry = geometry_of(spec)
    for param, rule, names, tp_rank, tp, owner in plan:
        shard = shard_from_hf(rule, checkpoint.read, names, param.tensor.shape, param.partition_dim, tp_rank, tp, geometry)
        if owner is None:
            param.tensor.copy_(shard.to(param.tensor.dtype))
        elif not torch.equal(shard.to(param.tensor.dtype), param.tensor):  # the owner is loaded by now
            raise CheckpointError(
                f"{names[0]!r} in {checkpoint.directory} differs from {owner!r}; Megatron's MTP layers share "
                "the main model's embedding and output layer, so the checkpoint's copies must equal them"
            )

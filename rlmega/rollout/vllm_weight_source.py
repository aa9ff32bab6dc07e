"""The trained Megatron model as a vLLM 0.33 ``WeightSource``: what vLLM's resharding weight-transfer backends send.

vLLM 0.33's trainer-side weight transfer (vllm/distributed/weight_transfer/base.py) reads the trainer's weights
through a ``WeightSource``: ``metadata``, every HF tensor of the model with its full shape and the trainer ranks
that own it, the same list on every rank (a ``ParamMeta`` each: ``owners`` in mesh order, ``placements`` one
``Shard(dim)`` or ``Replicate()`` per mesh axis, ``Shard`` splitting as ``torch.chunk`` does); ``iter_local()``,
this rank's piece of each tensor it owns; ``iter_full()``, each owned tensor whole. ``nccl_m2n`` sends every
rank's local piece and NCCL reshards it into each engine rank's own layout; ``sharded_rdt`` has each engine rank
pull only the slices its loaders read, from the full tensors. So an engine rank receives its slice, not the
model, which ``rlmega.rollout.engine_bytes`` counts.

``megatron_weight_source`` declares ``rlmega.bridge.pieces``' layout: each tensor owned by its TP group, split
along one dimension (``Shard``) or held whole by each owner. ``nccl_m2n_refusal`` says, before vLLM does, why
``nccl_m2n`` cannot take a layout: vllm/distributed/weight_transfer/m2n_common.py (``m2n_param_meta``) needs
every parameter owned by all trainer ranks in rank order, which only a trainer that is one tensor-parallel group
(no pipeline, data or expert parallelism) gives; ``sharded_rdt`` takes any owners.

``rlmega.sync.vllm_sharded.ShardedSync`` drives ``sharded_rdt`` with this source; ``nccl_m2n`` (NVIDIA's
nccl-extensions, a trainer that is one TP group) is not driven.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional

import torch

from rlmega.bridge.pieces import Piece, full_tensors, local_pieces, piece_layout
from rlmega.models.spec import ModelSpec


def vllm_param_metas(pieces: list[Piece], base) -> list:
    """``pieces`` as ``ParamMeta``s of ``base`` (vllm.distributed.weight_transfer.base): a one-axis mesh over
    the owners, split or replicated."""
    return [base.ParamMeta(piece.name, piece.dtype, piece.shape, owners=piece.owners,
                           placements=(base.Shard(piece.split_dim),) if piece.split_dim is not None else None)
            for piece in pieces]


def megatron_weight_source(chunks: list, spec: ModelSpec):
    """A ``WeightSource`` of vLLM 0.33 over the Megatron model ``chunks``.

    Collective: build it, read its ``metadata`` and iterate it on every trainer rank of the job (its global
    ranks are the ``TrainerInitInfo.rank``s), as vLLM's trainer engines do."""
    from vllm.distributed.weight_transfer import base

    class MegatronWeightSource(base.WeightSource):
        @functools.cached_property
        def metadata(self) -> list:
            return vllm_param_metas(piece_layout(chunks, spec), base)

        def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
            return local_pieces(chunks, spec)

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            return full_tensors(chunks, spec)

    return MegatronWeightSource()


def nccl_m2n_refusal(pieces: list[Piece], trainer_ranks: int) -> Optional[str]:
    """Why vLLM's ``nccl_m2n`` backend cannot take this layout (None: it can)."""
    everyone = tuple(range(trainer_ranks))
    for piece in pieces:
        if piece.owners != everyone:
            return (f"vLLM's nccl_m2n backend needs every tensor held by all {trainer_ranks} trainer ranks in "
                    f"order, but {piece.name} is held by ranks {list(piece.owners)}: the trainer must be a "
                    "single tensor-parallel group (tp = world size, no pipeline, data or expert parallelism); "
                    "use the sharded_rdt backend for other layouts")
    return None

"""The Megatron model as a vLLM 0.33 ``WeightSource`` (``rlmega.rollout.vllm_weight_source``), checked against
the wheel's ``ParamMeta`` rules (``fakes/fake_vllm_weight_transfer.py``, fields from ``api/vllm.json``).

On two and four ranks of real Megatron-Core (TP2; TP2 x PP2), every rank builds the source; its ``metadata`` is
the same on every rank and valid as vLLM checks it; ``iter_local()`` and ``iter_full()`` yield exactly
``owned_names(rank)``, in metadata order; and the checkpoint is rebuilt from the local pieces the way vLLM reads
them (``Shard(d)`` on a one-axis mesh: the owners' pieces concatenated along d in owner order; replicated: any
owner's tensor), bit for bit. ``nccl_m2n_refusal`` accepts the TP-only layout and names the tensor, its owners
and the way out for the pipelined one.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlmega.bridge import load_hf_weights
from rlmega.bridge.pieces import Piece, piece_layout
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.rollout.vllm_weight_source import megatron_weight_source, nccl_m2n_refusal

from .fakes import fake_vllm_weight_transfer
from .tiny_models import save_tiny_model

TIMEOUT_S = 180


def _source_on_rank(rank, world_size, layout, hf_dir):
    sys.modules.update(fake_vllm_weight_transfer.modules())
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    source = megatron_weight_source(chunks, spec)
    metas = [(m.name, m.dtype, m.shape, m.owners, m.mesh_shape, m.placements) for m in source.metadata]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, metas)
    result = {
        "metas": metas, "same_everywhere": all(other == metas for other in everyone),
        "owned": source.owned_names(rank), "cached": source.metadata is source.metadata,
        "local": [(name, tensor.clone()) for name, tensor in source.iter_local()],
        "full": [(name, tensor.clone()) for name, tensor in source.iter_full()],
        "pieces": piece_layout(chunks, spec),
    }
    destroy()
    return result


LAYOUTS = {"tp2": dict(tp=2, world_size=2), "tp2-pp2": dict(tp=2, pp=2, world_size=4)}


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_the_source_declares_and_yields_the_checkpoint_as_vllm_reads_it(layout_name, tmp_path):
    save_tiny_model("qwen3-moe", tmp_path, seed=0)
    layout = ParallelLayout(**LAYOUTS[layout_name])
    results = run_on_ranks(_source_on_rank, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(tmp_path)))
    saved = load_file(Path(tmp_path) / "model.safetensors")

    assert all(result["same_everywhere"] and result["cached"] for result in results)
    metas = {name: (shape, owners, mesh, placements)
             for name, _, shape, owners, mesh, placements in results[0]["metas"]}
    assert sorted(metas) == sorted(saved)
    local = {rank: dict(result["local"]) for rank, result in enumerate(results)}
    for rank, result in enumerate(results):
        assert [name for name, _ in result["local"]] == result["owned"] == [name for name, _ in result["full"]]
    sharded = 0
    for name, (shape, owners, mesh, placements) in metas.items():
        assert shape == tuple(saved[name].shape) and mesh == (len(owners),), name
        if placements is None:
            pieces = [local[owner][name] for owner in owners]
            assert all(torch.equal(piece, saved[name]) for piece in pieces), name
        else:
            (shard,) = placements
            sharded += 1
            assert torch.equal(torch.cat([local[owner][name] for owner in owners], dim=shard.dim), saved[name]), name
        for owner in owners:
            assert torch.equal(dict(results[owner]["full"])[name], saved[name]), name
    assert sharded > len(metas) // 2  # attention, dense and expert projections are split over the TP ranks

    refusal = nccl_m2n_refusal(results[0]["pieces"], layout.world_size)
    if layout.pp == 1:
        assert refusal is None
    else:
        assert "model.embed_tokens.weight is held by ranks [0, 1]" in refusal and "sharded_rdt" in refusal


def test_the_fake_refuses_what_vllm_refuses(monkeypatch):
    """The declarations the source could get wrong fail as the wheel fails them."""
    for name, module in fake_vllm_weight_transfer.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    from vllm.distributed.weight_transfer.base import ParamMeta, Replicate, Shard, WeightSource

    with pytest.raises(ValueError, match="distinct"):
        ParamMeta("w", torch.float32, (4, 4), owners=(1, 1))
    with pytest.raises(ValueError, match="shards dim 2"):
        ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), placements=(Shard(2),))
    with pytest.raises(TypeError, match="ParamMeta"):
        ParamMeta("w", torch.float32, (4, 4), (0, 1))  # owners is keyword-only in 0.33
    assert ParamMeta("w", torch.float32, (4,), owners=(0, 1), placements=(Replicate(),)).placements is None
    with pytest.raises(TypeError, match="cached_property"):
        class Plain(WeightSource):
            @property
            def metadata(self):
                return []


def test_nccl_m2n_refusal_names_the_first_tensor_not_held_by_every_rank():
    whole = Piece("model.norm.weight", torch.float32, (8,), (0, 1), None)
    split = Piece("model.layers.0.mlp.down_proj.weight", torch.float32, (8, 16), (0, 1), 1)
    assert nccl_m2n_refusal([whole, split], 2) is None
    expert = Piece("model.layers.0.mlp.experts.3.up_proj.weight", torch.float32, (16, 8), (1,), None)
    message = nccl_m2n_refusal([whole, expert, split], 2)
    assert "experts.3.up_proj" in message and "ranks [1]" in message and "sharded_rdt" in message
    assert nccl_m2n_refusal([whole], 4) is not None  # held by 2 of 4 ranks (a data-parallel trainer)

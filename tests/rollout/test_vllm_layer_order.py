"""vLLM's ``sharded_rdt`` transfers a source layer by layer: its trainer refuses metadata whose names of one layer
are not adjacent (api/rules.json sharded_rdt_group_contiguous: ``layerwise_groups`` of
vllm/distributed/weight_transfer/base.py, checked in sharded_rdt_trainer.py). The Megatron source
(``rlmega.rollout.vllm_weight_source``) is announced rank after rank, so under expert parallelism the experts the
second expert rank holds would follow every layer of the first; ``rlmega.bridge.pieces.in_layer_order`` puts each
layer back together. For a dense (TP2) and a MoE (EP2) tiny model the metadata keeps every layer's names adjacent;
without the ordering the fake trainer refuses the MoE model, as the wheel does."""

import os
import sys
import types

import pytest

from rlmega.parallel.spawn import run_on_ranks

from .fakes import fake_vllm_weight_transfer
from .tiny_models import save_tiny_model

TIMEOUT_S = 240


def _start_trainer(source, rank: int) -> str:
    """The fake sharded_rdt trainer's start on this source: "" or its refusal."""
    from vllm.distributed.weight_transfer.sharded_rdt_trainer import ShardedRDTTrainerInitInfo

    client = types.SimpleNamespace(init_weight_transfer_engine=lambda plan: None)
    try:
        fake_vllm_weight_transfer.WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(1, rank=rank), client=client, source=source)
    except ValueError as refusal:
        return str(refusal)
    return ""


def _metadata_on_rank(rank, world_size, hf_dir, folder, bypass, layout):
    os.environ["RLMEGA_FAKE_RDT_DIR"] = folder
    sys.modules.update(fake_vllm_weight_transfer.modules())
    from rlmega.bridge import load_hf_weights, pieces
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize
    from rlmega.rollout.vllm_weight_source import megatron_weight_source

    if bypass:  # the order the export announces its tensors in: each rank's, one rank after another
        pieces.in_layer_order = lambda units: units
    layout = ParallelLayout(world_size=world_size, **layout)
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    source = megatron_weight_source(chunks, spec)
    names = [meta.name for meta in source.metadata]
    found = {"names": names, "groups": fake_vllm_weight_transfer.layerwise_groups(names),
             "refusal": _start_trainer(source, rank)}
    destroy()
    return found


# A MoE model's experts are announced by their expert-parallel ranks, after the rank's dense parameters.
MODELS = {"llama": dict(tp=2), "qwen3-moe": dict(ep=2)}


def _metadata(model: str, folder, bypass: bool) -> dict:
    hf_dir = save_tiny_model(model, folder / "model", seed=0)
    results = run_on_ranks(_metadata_on_rank, 2, timeout_s=TIMEOUT_S,
                           args=(str(hf_dir), str(folder), bypass, MODELS[model]))
    assert results[0] == results[1]
    return results[0]


def _layer(name: str):
    parts = name.split(".")
    return next((int(part) for part in parts if part.isdigit()), None)


@pytest.mark.parametrize("model", MODELS)
def test_each_layers_names_are_adjacent_in_the_metadata(model, tmp_path):
    seen = _metadata(model, tmp_path, bypass=False)
    assert seen["refusal"] == ""
    assert [name for group in seen["groups"] for name in group] == seen["names"]
    layers = [_layer(name) for name in seen["names"] if _layer(name) is not None]
    assert layers == sorted(layers)  # each layer once, whole, in index order
    assert seen["names"][0] == "model.embed_tokens.weight"  # what leads, then the layers, then the tail
    assert _layer(seen["names"][-1]) is None
    assert ("moe" in model) == any(".experts." in name for name in seen["names"])


def test_without_the_layer_order_the_moe_source_is_refused_as_vllm_refuses_it(tmp_path):
    seen = _metadata("qwen3-moe", tmp_path, bypass=True)
    assert "metadata order is group-contiguous" in seen["refusal"]
    layers = [_layer(name) for name in seen["names"] if _layer(name) is not None]
    assert layers != sorted(layers)  # the second expert rank's experts of layer 0 after layer 1

"""Stored keys -> canonical per-layer names, for the key formats Megatron writes, on synthetic
torch_dist checkpoints (one process, no Megatron)."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converters.megatron_checkpoint import MegatronCheckpoint, leading_axes


def _save(state, directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return MegatronCheckpoint(directory)


@pytest.mark.parametrize("key, axes", [
    ("decoder.layers.self_attention.linear_qkv.weight", ["layer"]),
    ("decoder.layers.mlp.experts.experts.linear_fc1.weight", ["layer", "expert"]),
    ("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", ["expert"]),
    ("decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight", []),
    ("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight", ["expert"]),
    ("embedding.word_embeddings.weight", []),
])
def test_leading_axes(key, axes):
    assert leading_axes(key) == axes


def test_stacked_layers_and_experts_are_split_by_global_index(tmp_path):
    qkv, fc1 = torch.randn(3, 8, 4), torch.randn(3, 2, 6, 4)
    checkpoint = _save({"decoder.layers.self_attention.linear_qkv.weight": qkv,
                        "decoder.layers.mlp.experts.experts.linear_fc1.weight": fc1,
                        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(3, 4)}, tmp_path)
    params = {p.canonical: p for p in checkpoint.params(num_layers=3)}
    assert len(params) == 3 * 1 + 3 * 2 + 3
    assert "decoder.layers.2.input_layernorm.weight" in params  # the TE-style name, made canonical
    param = params["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert param.shape == (6, 4)
    [read] = checkpoint.read(list(param.parts))
    assert torch.equal(read, fc1[2, 1])
    [read] = checkpoint.read(list(params["decoder.layers.1.self_attention.linear_qkv.weight"].parts))
    assert torch.equal(read, qkv[1])


def test_singleton_local_shards_glu_halves_are_joined_and_mtp_is_renumbered(tmp_path):
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    checkpoint = _save({"decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w": gate,
                        "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_v": up,
                        "mtp.layers.0.enorm.weight": torch.ones(4)}, tmp_path)
    params = {p.canonical: p for p in checkpoint.params(num_layers=4)}
    assert sorted(params) == ["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", "mtp.layers.4.enorm.weight"]
    param = params["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert param.shape == (12, 4)
    assert torch.equal(torch.cat(checkpoint.read(list(param.parts))), torch.cat([gate, up]))

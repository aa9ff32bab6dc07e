"""mcore-to-hf: checkpoints saved by live models at TP=2×PP=2×EP=2 (MoE) and TP=2×PP=2×VPP=2
(dense, tied embeddings) become HF directories that transformers loads, bit-identical to the live
models' own export, with no process group in the converting process."""

import json

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from converter_checkpoints import CASES, ITERATION
from converters.mcore_to_hf import convert
from converters.megatron_checkpoint import MegatronCheckpoint, resolve_checkpoint_dir
from converters.safetensors_writer import INDEX_FILE
from rlmega.models import padded_vocab_size


def read_export(directory):
    index = json.loads((directory / INDEX_FILE).read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(directory / name, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_equals_live_model_export_bit_for_bit(case, checkpoints, hf_models, tmp_path):
    root, live = checkpoints[case]
    arch, _ = CASES[case]
    output = tmp_path / "hf"
    # A tiny bucket and shard size: many buckets and shards, so their boundaries are exercised.
    result = convert(root, output, hf_models[arch], bucket_bytes=64 * 1024, shard_bytes=128 * 1024, quiet=True)

    assert not dist.is_initialized()  # no process group was needed
    assert result.num_shards > 1
    exported = read_export(output)
    assert sorted(exported) == sorted(live), "exported keys differ from the live model's export"
    for name, tensor in live.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert (output / "tokenizer.json").read_text() == (hf_models[arch] / "tokenizer.json").read_text()
    assert (output / "generation_config.json").is_file()
    assert not list(tmp_path.glob(".*partial*"))

    model = AutoModelForCausalLM.from_pretrained(output)  # transformers takes it as it is
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], live["model.embed_tokens.weight"])
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_iteration_directory_and_its_parent_are_the_same_checkpoint(checkpoints):
    root, _ = checkpoints["moe-tp2-pp2-ep2"]
    assert resolve_checkpoint_dir(root) == root / f"iter_{ITERATION:07d}"
    assert resolve_checkpoint_dir(root / f"iter_{ITERATION:07d}") == root / f"iter_{ITERATION:07d}"


def test_checkpoint_is_read_in_the_tp1_layout_with_optimizer_state_skipped(checkpoints):
    """The stored global tensors are layer-stacked and TP-independent; optimizer keys (chained_i.
    optimizer.* for MoE) and _extra_state objects never reach the converter."""
    root, _ = checkpoints["moe-tp2-pp2-ep2"]
    checkpoint = MegatronCheckpoint(root)
    stored = checkpoint.metadata.state_dict_metadata
    assert any(key.startswith("chained_1.optimizer.state.exp_avg") for key in stored)
    assert any("_extra_state" in key for key in stored)
    params = {param.canonical: param for param in checkpoint.params(num_layers=4)}
    assert all("optimizer" not in name and "_extra_state" not in name for name in params)
    # Qwen3-MoE tiny: 4 query heads, 2 groups, head_dim 32 -> qkv rows 2 * (2 + 2) * 32.
    assert params["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (256, 64)
    assert params["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (64, 64)
    assert params["decoder.layers.0.input_layernorm.weight"].shape == (64,)  # stored as linear_qkv.layer_norm_weight
    assert params["embedding.word_embeddings.weight"].shape == (padded_vocab_size(100, 2), 64)  # Megatron's padding

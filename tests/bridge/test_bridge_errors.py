"""Checkpoints that do not fit the model fail with an error naming the tensor; imports read slices."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import save_tiny_model
from rlmega.bridge import HFCheckpoint, load_hf_weights
from rlmega.models import UnsupportedModelError, build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import RankFailure, run_on_ranks


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", directory)
    return directory


def _variant(source: Path, target: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(source, target)
    if edit_tensors:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def _load(rank, world_size, layout, directory, count_reads):
    initialize(layout)
    spec = model_spec_from_hf(directory)
    chunks = build_chunks(spec, layout)
    read_bytes = []
    if count_reads:
        original = HFCheckpoint.read

        def counting_read(self, key, rows=None, cols=None):
            tensor = original(self, key, rows, cols)
            read_bytes.append(tensor.numel() * tensor.element_size())
            return tensor

        HFCheckpoint.read = counting_read
    load_hf_weights(chunks, spec, directory)
    destroy()
    return sum(read_bytes)


def _load_error(directory) -> str:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_load, 1, timeout_s=90, args=(ParallelLayout(), str(directory), False))
    assert "CheckpointError" in failure.value.detail
    return failure.value.detail.strip().splitlines()[-1]


def test_missing_tensor_is_named(llama_dir, tmp_path):
    directory = _variant(llama_dir, tmp_path / "ckpt", edit_tensors=lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    assert "is missing 'model.layers.2.mlp.up_proj.weight', which the model config needs" in _load_error(directory)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    directory = _variant(llama_dir, tmp_path / "ckpt", edit_tensors=add)
    message = _load_error(directory)
    assert "has 'model.layers.0.self_attn.rotary_emb.inv_freq', which the model config does not use" in message


def test_config_that_does_not_match_the_shapes_names_the_tensor(llama_dir, tmp_path):
    directory = _variant(llama_dir, tmp_path / "ckpt", edit_config=lambda c: c.update(intermediate_size=80))
    message = _load_error(directory)
    assert "'model.layers.0.mlp.down_proj.weight' has shape [64, 96]" in message
    assert "but the model config implies [64, 80]" in message


def test_missing_shard_file_is_named(llama_dir, tmp_path):
    directory = tmp_path / "sharded"
    shutil.copytree(llama_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:10]}, directory / "model-00001-of-00002.safetensors")
    weight_map = {k: ("model-00001-of-00002.safetensors" if i < 10 else "model-00002-of-00002.safetensors") for i, k in enumerate(names)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    message = _load_error(directory)
    assert "is listed in model-00002-of-00002.safetensors, which does not exist" in message


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as error:
        model_spec_from_hf({"architectures": ["GPT2LMHeadModel"]})
    assert str(error.value).startswith("architecture ['GPT2LMHeadModel'] is not supported; supported: LlamaForCausalLM,")


def test_each_tensor_parallel_rank_reads_only_its_slices(llama_dir):
    total = sum(t.numel() * t.element_size() for t in load_file(llama_dir / "model.safetensors").values())
    per_rank = run_on_ranks(_load, 2, timeout_s=90, args=(ParallelLayout(tp=2, world_size=2), str(llama_dir), True))
    norms = sum(t.numel() * t.element_size() for k, t in load_file(llama_dir / "model.safetensors").items() if t.dim() == 1)
    # Split tensors are read once across the two ranks, replicated norms by both; no rank reads
    # much more than half (the vocabulary rows of a padded vocab may all sit on one rank).
    assert sum(per_rank) == total + norms
    assert max(per_rank) < 0.6 * total


def test_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    directory = tmp_path / "qwen2-tied"
    save_tiny_model("qwen2-tied", directory)

    def add_head(tensors):
        tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])

    directory = _variant(directory, tmp_path / "ckpt", edit_tensors=add_head)
    message = _load_error(directory)
    assert "holds its own 'lm_head.weight', different from 'model.embed_tokens.weight'" in message

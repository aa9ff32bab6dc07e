"""The merged export's safetensors files: one file while the model fits a shard, else shards and their index."""

import json

import torch
from safetensors.torch import load_file

from rlmega.trainer import lora_export


def test_shards_and_their_index(tmp_path, monkeypatch):
    monkeypatch.setattr(lora_export, "EXPORT_SHARD_BYTES", 64)
    writer = lora_export._ShardWriter(tmp_path)
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(3)}  # 40 bytes each: one per shard
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 120 and sorted(set(index["weight_map"].values())) == [
        "model-00001.safetensors", "model-00002.safetensors", "model-00003.safetensors"]
    for name, file_name in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / file_name)[name], tensors[name])


def test_one_file_when_the_model_fits(tmp_path):
    writer = lora_export._ShardWriter(tmp_path)
    writer.add("w", torch.ones(3))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

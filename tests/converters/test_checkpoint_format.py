"""Stored keys -> canonical per-layer names, for the key formats Megatron writes, on synthetic
torch_dist checkpoints (one process, no Megatron)."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converters.chunk_reader import DirectChunkReader, locate_tensor_bytes
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


def _archive(tensor, tmp_path):
    """A file holding 5 bytes of something else, then ``torch.save(tensor)``, as in a .distcp file."""
    path = tmp_path / "archive.bin"
    with open(path, "wb") as handle:
        handle.write(b"xxxxx")
        torch.save(tensor, handle)
    return path, 5, path.stat().st_size - 5


def test_raw_bytes_of_a_plain_tensor_are_found(tmp_path):
    tensor = torch.randn(3, 5)
    path, offset, length = _archive(tensor, tmp_path)
    with open(path, "rb") as stream:
        start = locate_tensor_bytes(stream, offset, length, (3, 5), torch.float32)
        stream.seek(offset + start)
        raw = stream.read(tensor.numel() * 4)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(3, 5), tensor)


@pytest.mark.parametrize("tensor, size, dtype", [
    (torch.randn(5, 3).t(), (3, 5), torch.float32),  # not contiguous: torch's own reader must handle it
    (torch.randn(3, 5), (3, 5), torch.bfloat16),  # other dtype than the metadata says
    (torch.randn(4, 5)[1:], (3, 5), torch.float32),  # a view into a larger storage
])
def test_anything_but_a_plain_tensor_is_left_to_torch(tensor, size, dtype, tmp_path):
    path, offset, length = _archive(tensor, tmp_path)
    with open(path, "rb") as stream:
        assert locate_tensor_bytes(stream, offset, length, size, dtype) is None


def test_direct_reads_equal_torch_reads_on_a_megatron_checkpoint(checkpoints, monkeypatch):
    """Chunks read straight into place (most here) and through torch's reader give the same bytes."""
    root, _ = checkpoints["moe-tp2-pp2-ep2"]
    checkpoint = MegatronCheckpoint(root)
    regions = [region for param in checkpoint.params(num_layers=4) for region in param.parts]
    direct, fallback = [], []
    read_whole_chunk = DirectChunkReader._read_whole_chunk

    def counting(self, stream, item, planner):
        done = read_whole_chunk(self, stream, item, planner)
        (direct if done else fallback).append(item)
        return done

    monkeypatch.setattr(DirectChunkReader, "_read_whole_chunk", counting)
    ours = checkpoint.read(regions)
    monkeypatch.setattr(DirectChunkReader, "_read_whole_chunk", lambda self, stream, item, planner: False)
    theirs = checkpoint.read(regions)
    assert len(direct) > len(fallback) > 0  # column-split chunks land in non-contiguous slices
    for region, a, b in zip(regions, ours, theirs):
        assert torch.equal(a, b), region.key

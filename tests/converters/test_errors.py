"""Every bad input stops the conversion up front with one line that names the problem and the fix,
and leaves nothing at (or beside) the output path."""

import json
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from converter_checkpoints import ITERATION
from converters import ConversionError
from converters import hf_to_mcore, mcore_to_hf
from converters.safetensors_writer import ShardedSafetensorsWriter


def _iteration(root):
    return root / f"iter_{ITERATION:07d}"


def _convert(root, output, hf_base, **kwargs):
    return mcore_to_hf.convert(root, output, hf_base, quiet=True, **kwargs)


def assert_fails(match, call, output):
    with pytest.raises(ConversionError, match=match) as failure:
        call()
    message = str(failure.value)
    assert "\n" not in message and "; " in message, message  # one line: the problem; the fix
    assert not output.exists() or output.name == "existing"
    assert not list(output.parent.glob(f".{output.name}.partial*"))
    return message


def test_missing_shard_file(dense_copy, hf_models, tmp_path):
    shard = sorted(_iteration(dense_copy).glob("*.distcp"))[-1]
    shard.unlink()
    message = assert_fails("is missing", lambda: _convert(dense_copy, tmp_path / "out", hf_models["qwen2-tied"]), tmp_path / "out")
    assert shard.name in message and "copy the complete checkpoint" in message


def test_truncated_shard_file(dense_copy, hf_models, tmp_path):
    """Cut inside a chunk the conversion needs (the word embeddings'): where the model's chunks sit in a file, among
    the optimizer's, differs between Megatron-Core releases."""
    from rlmega.bridge.torch_dist_files import read_index

    index = read_index(_iteration(dense_copy))
    chunk = next(info for key, info in index.storage_data.items() if key.fqn == "embedding.word_embeddings.weight")
    shard = _iteration(dense_copy) / chunk.relative_path
    shard.write_bytes(shard.read_bytes()[: chunk.offset + chunk.length // 2])
    message = assert_fails("truncated", lambda: _convert(dense_copy, tmp_path / "out", hf_models["qwen2-tied"]), tmp_path / "out")
    assert str(shard) in message


def test_corrupt_shard_contents(dense_copy, hf_models, tmp_path):
    """Right size, wrong bytes: found while reading; the partial output is removed."""
    shard = sorted(_iteration(dense_copy).glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    assert_fails("damaged", lambda: _convert(dense_copy, tmp_path / "out", hf_models["qwen2-tied"]), tmp_path / "out")


def _other_base(hf_dir, tmp_path, **changes):
    """An HF base directory: ``hf_dir``'s config.json with ``changes``, and no weights."""
    config = json.loads((hf_dir / "config.json").read_text())
    directory = tmp_path / "base"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("arch, changes, match", [
    ("qwen2-tied", dict(intermediate_size=128), "shape"),  # same architecture, other sizes
    ("qwen2-tied", dict(num_hidden_layers=6, layer_types=["full_attention"] * 6), "no tensor for 'model.layers.4"),
    ("llama", dict(), "which a LlamaForCausalLM model"),  # Llama has no qkv bias; Qwen2 has
])
def test_hf_base_that_does_not_match_the_checkpoint(arch, changes, match, checkpoints, hf_models, tmp_path):
    root, _ = checkpoints["dense-tp2-pp2-vpp2"]
    base = _other_base(hf_models[arch], tmp_path, **changes)
    message = assert_fails(match, lambda: _convert(root, tmp_path / "out", base), tmp_path / "out")
    assert "--hf-base" in message


def test_checkpoint_with_only_optimizer_state(hf_models, tmp_path):
    directory = tmp_path / "optimizer-only"
    state = {"optimizer.state.exp_avg.decoder.final_layernorm.weight": torch.zeros(64),
             "chained_1.optimizer.state.exp_avg_sq.output_layer.weight": torch.zeros(8, 64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    message = assert_fails("no model weights", lambda: _convert(directory, tmp_path / "out", hf_models["qwen2-tied"]), tmp_path / "out")
    assert "optimizer" in message


def test_not_a_checkpoint(hf_models, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_fails("not a torch_dist checkpoint", lambda: _convert(tmp_path / "empty", tmp_path / "out", hf_models["llama"]), tmp_path / "out")


def test_output_that_exists_is_refused_unless_overwrite(checkpoints, hf_models, tmp_path):
    root, live = checkpoints["dense-tp2-pp2-vpp2"]
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert_fails("--overwrite", lambda: _convert(root, existing, hf_models["qwen2-tied"]), existing)
    assert (existing / "keep.txt").read_text() == "mine"

    _convert(root, existing, hf_models["qwen2-tied"], overwrite=True)
    assert not (existing / "keep.txt").exists() and (existing / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_not_enough_disk_space_is_found_before_writing(checkpoints, hf_models, tmp_path, monkeypatch):
    root, _ = checkpoints["dense-tp2-pp2-vpp2"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    message = assert_fails("not enough disk space", lambda: _convert(root, tmp_path / "out", hf_models["qwen2-tied"]), tmp_path / "out")
    assert "free" in message


def test_interrupted_conversion_leaves_nothing_that_looks_complete(checkpoints, hf_models, tmp_path, monkeypatch):
    root, _ = checkpoints["moe-tp2-pp2-ep2"]
    real_write, calls = ShardedSafetensorsWriter.write, []

    def write_then_interrupt(self, name, tensor):
        calls.append(name)
        if len(calls) == 20:
            raise KeyboardInterrupt
        real_write(self, name, tensor)

    monkeypatch.setattr(ShardedSafetensorsWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _convert(root, tmp_path / "out", hf_models["qwen3-moe"], bucket_bytes=32 * 1024, shard_bytes=64 * 1024)
    assert list(tmp_path.iterdir()) == []


def test_hf_to_mcore_refuses_bad_inputs_before_starting_ranks(hf_models, tmp_path, monkeypatch):
    hf = hf_models["llama"]
    layout = hf_to_mcore.layout_for(tp=2)
    existing = tmp_path / "existing"
    existing.mkdir()
    assert_fails("--overwrite", lambda: hf_to_mcore.convert(hf, existing, layout, quiet=True), existing)
    assert_fails("num_attention_heads|divis", lambda: hf_to_mcore.convert(hf, tmp_path / "out", hf_to_mcore.layout_for(tp=3), quiet=True),
                 tmp_path / "out")

    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    (broken / "model.safetensors").rename(broken / "model-00001-of-00001.safetensors")
    (broken / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}')
    assert_fails("missing", lambda: hf_to_mcore.convert(broken, tmp_path / "out", layout, quiet=True), tmp_path / "out")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert_fails("not enough disk space", lambda: hf_to_mcore.convert(hf, tmp_path / "out", layout, quiet=True), tmp_path / "out")


def _tied_with_own_head(hf_dir, tmp_path, head_equals_embedding: bool):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "tied-with-head"
    shutil.copytree(hf_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone() if head_equals_embedding else torch.randn_like(embedding)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_tied_config_with_a_different_stored_head_is_refused(hf_models, tmp_path):
    """A config that ties the head, with weights that hold a head of their own, would silently lose the head."""
    source = _tied_with_own_head(hf_models["qwen2-tied"], tmp_path, head_equals_embedding=False)
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is True
    message = assert_fails("holds its own 'lm_head.weight', different from 'model.embed_tokens.weight'",
                           lambda: hf_to_mcore.convert(source, tmp_path / "out", hf_to_mcore.layout_for(), quiet=True),
                           tmp_path / "out")
    assert '"tie_word_embeddings": false' in message and "delete 'lm_head.weight'" in message


def test_tied_config_with_an_equal_stored_head_converts(hf_models, tmp_path):
    source = _tied_with_own_head(hf_models["qwen2-tied"], tmp_path, head_equals_embedding=True)
    hf_to_mcore.convert(source, tmp_path / "out", hf_to_mcore.layout_for(), quiet=True)
    assert (tmp_path / "out").exists()

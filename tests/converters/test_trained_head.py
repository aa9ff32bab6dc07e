"""A checkpoint trained with an LM head of its own keeps it on export, also under an ``--hf-base`` whose config.json
ties the head to the embedding: the export writes the head and ``tie_word_embeddings: false``, and says so."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmega.cli.main import main
from rlmega.trainer.controller import export_hf
from test_mcore_to_hf import read_export

NOTE = "note: the checkpoint has an output layer of its own, which {base}/config.json ties to the embedding"


@pytest.fixture(scope="module")
def trained_head(hf_models, tmp_path_factory):
    """(the tied base, the model with a head of its own, its torch_dist checkpoint root as training leaves it)."""
    root = tmp_path_factory.mktemp("trained-head")
    base = hf_models["qwen2-tied"]
    untied = root / "untied"
    shutil.copytree(base, untied)
    tensors = load_file(untied / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, untied / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    checkpoint = root / "checkpoint"
    assert main(["convert", "hf-to-mcore", str(untied), str(checkpoint), "--iteration", "1", "--quiet"]) == 0
    return base, untied, checkpoint


def _assert_untied_export(directory, untied):
    exported = read_export(directory)
    assert torch.equal(exported["lm_head.weight"], load_file(untied / "model.safetensors")["lm_head.weight"])
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is False


def test_mcore_to_hf_keeps_a_trained_head_under_a_tied_base(trained_head, tmp_path, capsys):
    base, untied, checkpoint = trained_head
    assert json.loads((base / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["convert", "mcore-to-hf", str(checkpoint), str(out), "--hf-base", str(base), "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("note:")] == [
        NOTE.format(base=base) + ": it is written as lm_head.weight, with tie_word_embeddings: false in config.json"]
    _assert_untied_export(out, untied)
    assert main(["convert", "verify", str(out), str(untied)]) == 0  # every tensor, the head included


def test_the_trainers_export_takes_the_same_path(trained_head, tmp_path, capsys):
    base, untied, checkpoint = trained_head
    export_hf(checkpoint, tmp_path / "hf", str(base))
    assert NOTE.format(base=base) in capsys.readouterr().out
    _assert_untied_export(tmp_path / "hf", untied)

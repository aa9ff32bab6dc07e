"""A tied-embedding HF checkpoint that also stores ``lm_head.weight`` (equal to the embedding, as
many Qwen and Llama checkpoints do) round-trips through torch_dist with exactly its own keys."""

import pytest
import torch
from safetensors.torch import load_file

from rlmega.cli.main import main
from test_errors import _tied_with_own_head
from test_mcore_to_hf import read_export


@pytest.mark.parametrize("layout", [[], ["--pp", "2"]], ids=["single-rank", "pp2"])
def test_stored_tied_head_round_trips_bit_identical(hf_models, tmp_path, layout):
    source = _tied_with_own_head(hf_models["qwen2-tied"], tmp_path, head_equals_embedding=True)
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(source), str(megatron), *layout, "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(megatron), str(back), "--hf-base", str(source), "--quiet"]) == 0
    assert main(["convert", "verify", str(back), str(source)]) == 0
    original, exported = load_file(source / "model.safetensors"), read_export(back)
    assert sorted(exported) == sorted(original) and "lm_head.weight" in exported
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_tied_model_without_a_stored_head_still_exports_none(hf_models, tmp_path):
    """The record is the source's: a tied checkpoint that stores no head gets none back."""
    source = hf_models["qwen2-tied"]
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(source), str(megatron), "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(megatron), str(back), "--hf-base", str(source), "--quiet"]) == 0
    assert "lm_head.weight" not in read_export(back)
    assert main(["convert", "verify", str(back), str(source)]) == 0

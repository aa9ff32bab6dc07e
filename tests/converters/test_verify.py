"""verify: bit-identical tensors pass; any other difference is listed by key and fails; a dtype
change is judged by fp32 logits on probe tokens within --atol."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.verify import verify
from rlmega.cli.main import main


@pytest.fixture
def reference(hf_models):
    return hf_models["llama"]


def _variant(reference, tmp_path, change):
    """A copy of ``reference`` whose tensors are ``change(dict of tensors)``."""
    directory = tmp_path / "variant"
    shutil.copytree(reference, directory)
    tensors = load_file(reference / "model.safetensors")
    save_file(change(tensors), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_identical_copy_passes(reference, tmp_path, capsys):
    copy = _variant(reference, tmp_path, lambda tensors: tensors)
    report = verify(copy, reference, logits=True)
    assert report.ok and report.num_identical == report.num_compared > 0
    assert report.logits_max_abs_diff == 0.0
    assert main(["convert", "verify", str(copy), str(reference)]) == 0
    assert "match" in capsys.readouterr().out


def test_changed_tensor_is_named(reference, tmp_path, capsys):
    name = "model.layers.2.mlp.down_proj.weight"

    def nudge(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] += 1e-6
        return tensors

    report = verify(_variant(reference, tmp_path, nudge), reference)
    assert not report.ok and len(report.differences) == 1 and report.differences[0].startswith(name)
    assert main(["convert", "verify", str(tmp_path / "variant"), str(reference)]) == 1
    assert f"DIFF {name}: values differ" in capsys.readouterr().out


def test_missing_and_extra_keys_are_named(reference, tmp_path):
    def rename(tensors):
        tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
        return tensors

    report = verify(_variant(reference, tmp_path, rename), reference, logits=True)
    assert report.structural and report.logits_max_abs_diff is None  # not comparable by logits
    assert any(d.startswith("model.norm.weight: missing") for d in report.differences)
    assert any(d.startswith("model.extra.weight: not in the reference") for d in report.differences)


def test_other_dtype_is_judged_by_logits(reference, tmp_path):
    halved = _variant(reference, tmp_path, lambda tensors: {k: v.to(torch.bfloat16) for k, v in tensors.items()})
    loose = verify(halved, reference, atol=0.05)  # bf16 weights: logits within a few 1e-3 here
    assert loose.ok and loose.notes and 0 < loose.logits_max_abs_diff <= 0.05
    strict = verify(halved, reference, atol=1e-7)
    assert not strict.ok and strict.differences[-1].startswith("logits: max abs diff")

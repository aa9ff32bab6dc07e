"""What real checkpoints and layouts need from `rlmega convert hf-to-mcore`: uneven pipeline stages (a
5-layer model over pp=2, as DeepSeek-V3's 61 layers need for every pp), a DeepSeek-V3 checkpoint exactly
as transformers' save_pretrained writes it (config.json announces an MTP layer its weights do not hold)
with a routing setting only training cares about, and multi-rank failures told in one line."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from rlmega.cli.main import main
from rlmega.models import UnsupportedModelError, model_spec_from_hf
from test_mcore_to_hf import read_export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))
from deepseek_models import tiny_config  # noqa: E402
from hf_models import COMMON  # noqa: E402


def _save(config, directory: Path) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # norms and biases off their init, so a misplaced layer shows
        for tensor in model.state_dict(keep_vars=True).values():
            if tensor.dim() == 1:
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def _round_trip(hf: Path, tmp_path: Path, *layout: str) -> tuple[dict, str]:
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(hf), str(megatron), *layout, "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(megatron), str(back), "--hf-base", str(hf), "--quiet"]) == 0
    return read_export(back), (back / "config.json").read_text()


def test_uneven_stages_round_trip_through_hf_to_mcore_at_pp2(tmp_path, capsys):
    hf = tmp_path / "hf"
    original = _save(LlamaConfig(**dict(COMMON, num_hidden_layers=5)), hf)
    capsys.readouterr()
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "even"), "--pp", "2", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rlmega convert hf-to-mcore: error: num_layers=5 is not divisible by pp*vpp = 2*1 = 2; with pp=2: set "
        "last_stage_layers=2 (3 on each other stage) or set first_stage_layers=2 (3 on each other stage); "
        "pp values that split it evenly: 1, 5")
    exported, _ = _round_trip(hf, tmp_path, "--pp", "2", "--first-stage-layers", "2")
    assert "tp=1 pp=2 first_stage_layers=2 cp=1" in capsys.readouterr().out
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_a_deepseek_checkpoint_as_transformers_saves_it_converts(tmp_path, capsys):
    """num_nextn_predict_layers=1 (DeepseekV3Config's default) without MTP weights, and group-limited
    routing Megatron cannot reproduce (num_experts_per_tok // topk_group = 1): weight conversion builds
    without MTP, says so once, and round-trips bit for bit; training refuses the routing with the reason."""
    hf = tmp_path / "hf"
    original = _save(tiny_config(num_nextn_predict_layers=1, topk_group=2), hf)
    capsys.readouterr()
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(name.startswith("model.layers.4.") for name in original)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=2 with topk_group=2 is not supported for training"):
        model_spec_from_hf(hf)
    exported, config_json = _round_trip(hf, tmp_path, "--ep", "2")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: config.json says num_nextn_predict_layers=1, but {hf} holds no MTP weights "
                     "(model.layers.4.*, as transformers' save_pretrained writes it): building without MTP "
                     "(mtp=auto; on / off decide)"]
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads(config_json)["num_nextn_predict_layers"] == 1  # the config as it came


def test_a_failure_on_the_ranks_is_one_line_without_rank_or_warnings(tmp_path, capfd):
    hf = tmp_path / "hf"
    tensors = _save(LlamaConfig(**COMMON), hf)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "out"), "--tp", "2", "--quiet"]) == 2
    err = capfd.readouterr().err  # the ranks' own stderr included
    assert err.strip().splitlines() == [
        f"rlmega convert hf-to-mcore: error: checkpoint {hf} is missing 'model.layers.1.mlp.up_proj.weight', "
        "which the model config needs"]

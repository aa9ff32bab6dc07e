"""A quickstart-size GRPO run with LoRA adapters on the actor: the reference is the actor with its adapters off (no
reference model), the engines serve the merged weights (the post-sync check passes), checkpoints hold the adapters
(and, after the warm-start folded them into the base, the whole model), and a final HF export is written."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_trainer_runs import _rows, _train



@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "trainer.total_steps=2", "export_hf=true"]


def test_lora_grpo_run(tmp_path, assets):
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, *LORA)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["sync/max_logprob_diff"] < 1e-3  # the engine serves the merged weights
        assert row["actor/kl_loss"] >= 0 and "timing_s/ref" in row
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / "ref").exists()
    metadata = json.loads((checkpoints / "actor" / "iter_0000002" / "rlmega.json").read_text())
    assert metadata["model"] == "whole"  # the warm-start folded the adapters into the base
    assert (run_dir / "hf" / "config.json").is_file() and not (run_dir / "hf_adapter").exists()
    assert "no PEFT adapter written" in result.stdout


def test_lora_run_without_warm_start_saves_adapters_alone(tmp_path, assets):
    run_dir = tmp_path / "run"
    # The untrained model earns no reward; the entropy bonus moves the adapters all the same.
    result = _train(run_dir, assets, *LORA, "trainer.sft_steps=0", "trainer.total_steps=1",
                    "actor.policy_loss.entropy_coeff=0.01")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _rows(run_dir)[0]["sync/max_logprob_diff"] < 1e-3
    metadata = json.loads((run_dir / "checkpoints" / "actor" / "iter_0000001" / "rlmega.json").read_text())
    assert metadata["model"] == "adapters"
    # The PEFT adapter applied to the base model as PEFT applies it is the merged checkpoint.
    adapter = load_file(run_dir / "hf_adapter" / "adapter_model.safetensors")
    config = json.loads((run_dir / "hf_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    base = load_file(run_dir / "assets" / "model" / "model.safetensors")
    merged = load_file(run_dir / "hf" / "model.safetensors")
    assert merged.keys() == base.keys()
    for name, weight in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapter:
            a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
            weight = weight + config["lora_alpha"] / config["r"] * b @ a
        torch.testing.assert_close(merged[name], weight, atol=1e-6, rtol=0, msg=name)
    assert any(not torch.equal(merged[name], base[name]) for name in base)  # the step moved the adapters


def test_lora_merged_weights_through_the_sliced_transport(tmp_path, assets):
    # Every training rank sends its own merged shards (the bridge's held pieces) to the engines.
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, *LORA, "trainer.sft_steps=0", "trainer.total_steps=1", "export_hf=false",
                    "actor.policy_loss.entropy_coeff=0.01", "rollout.placement=disaggregated",
                    "rollout.num_engines=2", "sync.transport=sliced", "actor.optimizer.lr=5e-3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    row = _rows(run_dir)[0]
    assert row["actor/grad_norm"] > 0 and row["sync/max_logprob_diff"] < 1e-3

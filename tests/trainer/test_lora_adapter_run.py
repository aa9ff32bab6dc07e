"""A two-step GRPO run of a LoRA actor on Ray with vLLM engines (the fake vllm 0.33 of tests/rollout/fakes, installed
as ``vllm`` in every process of the run) and ``sync.lora=adapters``: each sync sends the adapters alone, far fewer
bytes than the model, and the post-sync check finds the engine's log-probs equal to the trainer's (the fake computes
in fp32 and applies the adapter it loads)."""

import os

import pytest
from safetensors import safe_open

from tests.trainer.test_trainer_runs import ROOT, _rows, _train

SHIM = """import sys
from tests.rollout.fakes import fake_vllm
sys.modules["vllm.lora.request"] = fake_vllm.lora_request_module
sys.modules["vllm"] = fake_vllm
"""


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


@pytest.mark.timeout(600)
def test_a_grpo_run_syncs_the_adapters_alone_into_vllm(tmp_path, assets):
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIM)
    path = os.pathsep.join(filter(None, [str(shim.parent), str(ROOT), os.environ.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, "rollout.backend=vllm", "actor.lora.rank=4", "sync.lora=adapters",
                    "trainer.total_steps=2", "sync.post_sync_atol=1e-3", "actor.policy_loss.entropy_coeff=0.01",
                    timeout_s=540, env={"PYTHONPATH": path})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    with safe_open(run_dir / "assets" / "model" / "model.safetensors", "pt") as model:
        model_bytes = sum(model.get_tensor(name).nbytes for name in model.keys())
    for row in rows:
        synced = row["sync/gbytes"] * 1e9
        print(f"step {row['step']}: synced {synced:.0f} bytes, the model is {model_bytes}: "
              f"{model_bytes / synced:.1f}x fewer")
        assert synced * 10 < model_bytes
        assert row["sync/max_logprob_diff"] < 1e-3  # the engine applies the trained adapters

"""A two-step GRPO run of a LoRA actor on Ray with vLLM or SGLang engines (the fake vllm 0.33 or sglang 0.5.23 of
tests/rollout/fakes, installed as ``vllm`` / ``sglang`` in every process of the run) and ``sync.lora=adapters``: each
sync sends the adapters alone, far fewer bytes than the model, and the post-sync check finds the engine's log-probs
equal to the trainer's (the fakes compute in fp32 and apply the adapter they load)."""

import os

import pytest
from safetensors import safe_open

from tests.trainer.test_trainer_runs import ROOT, _rows, _train

SHIMS = {
    "vllm": """import sys
from tests.rollout.fakes import fake_vllm
sys.modules["vllm.lora.request"] = fake_vllm.lora_request_module
sys.modules["vllm"] = fake_vllm
""",
    "sglang": """import sys
from tests.rollout.fakes import fake_sglang
sys.modules["sglang"] = fake_sglang
""",
}
# Colocated engines sleep at level 1 between syncs, which SGLang does only with a CPU copy of the weights.
ENGINE_SETTINGS = {"vllm": [], "sglang": ["+rollout.engine_kwargs.enable_weights_cpu_backup=true"]}


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_grpo_run_syncs_the_adapters_alone_into_the_engines(tmp_path, assets, backend):
    shim = tmp_path / "shim" / backend
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIMS[backend])
    path = os.pathsep.join(filter(None, [str(shim.parent), str(ROOT), os.environ.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, f"rollout.backend={backend}", "actor.lora.rank=4", "sync.lora=adapters",
                    "trainer.total_steps=2", "sync.post_sync_atol=1e-3", "actor.policy_loss.entropy_coeff=0.01",
                    *ENGINE_SETTINGS[backend], timeout_s=540, env={"PYTHONPATH": path})
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

"""Cluster tier, a node of at least 4 GPUs: a real sliced refit over NCCL (``rlmega.sync.sliced_emulation``), timed
against the plan. Training ranks (TP2, on GPUs 0-1) of a random Qwen3 model large enough to be bound by bandwidth
(about 0.5 GB in bf16) feed one engine of TP2 on GPUs 2-3: every engine rank ends with its region bit for bit, each
rank's bytes per link are the plan's, and the measured time of the second update (the group is built by then) is
printed beside the planner's prediction for the same plan (``rlmega.plan.sliced_refit.gpu_times``, the GPU's NVLink
preset, ``plan.message_latency_us``). The check fails only if the refit is more than 20 times the prediction:
NCCL's first-use costs and Python's packing are not in the model. CPU twin: tests/sync/test_sliced.py (the same
emulation over gloo).
"""

import json

import numpy as np
import pytest
import torch

from .measures import measured

pytestmark = pytest.mark.gpu

CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, intermediate_size=5632,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              torch_dtype="bfloat16")


def _save_model(directory) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**{key: value for key, value in CONFIG.items() if key not in ("architectures", "model_type")})
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                       "architectures": CONFIG["architectures"]}))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs: two training ranks, one engine of TP2")
def test_a_sliced_refit_matches_its_plan_on_gpus(tmp_path):
    from safetensors.torch import load_file

    from rlmega.parallel.layout import ParallelLayout
    from rlmega.plan.config import GPU_PRESETS
    from rlmega.plan.sliced_refit import gpu_times
    from rlmega.rollout.engine_bytes import EngineLayout
    from rlmega.sync.sliced_emulation import Emulation, emulate

    _save_model(tmp_path)
    emulation = Emulation(str(tmp_path), ParallelLayout(tp=2, world_size=2), EngineLayout(2, dtype_bytes=2),
                          num_engines=1, gpus_per_node=8, colocated=False, bucket_bytes=64 * 1024**2, updates=2,
                          timeout_s=280)
    report = emulate(emulation)
    checkpoint = {name: tensor for name, tensor in load_file(next(tmp_path.glob("*.safetensors"))).items()}
    assert report.errors == [[], []]
    for update in range(2):
        assert report.mismatches(update, checkpoint) == []
        sent, received = report.measured(update)
        assert np.array_equal(sent, report.plan.traffic.sent_bytes)
        assert np.array_equal(received, report.plan.traffic.received_bytes)
    name = torch.cuda.get_device_name(0)
    preset = next((preset for key, preset in GPU_PRESETS.items() if key in name), GPU_PRESETS["H100"])
    predicted = gpu_times(report.plan.traffic, {"nvlink": preset.nvlink_gb_per_s, "network": 50.0}, 20e-6)[0].seconds
    print(measured(sliced_refit_s=report.seconds[1], predicted_s=predicted,
                   gigabytes=report.plan.traffic.total_bytes / 1e9))
    assert report.seconds[1] < 20 * predicted

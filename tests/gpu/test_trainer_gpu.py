"""Cluster tier: three GRPO steps of ``rlmega train`` with a real vLLM or SGLang engine on GPUs, on the
quickstart's tiny model, in the precision users run (a bf16 actor; the engine's own dtype, bf16 for this
float32 checkpoint), so the post-sync check runs at its bf16 tolerance after every step.

- colocated: one training rank and one engine on GPU 0; the engine has no GPU of its own and runs on the
  rank's (rlmega/trainer/engine_devices.py); training offloads while it generates, and it sleeps while
  training runs.
- disaggregated: the engine on a GPU of its own, the weights over NCCL (needs two GPUs).
- vLLM's sharded_rdt transfer (``sync.transport=sharded_rdt``), colocated: the engine's workers pull the
  weights from the training rank's producer (needs Ray >= 2.56 with NIXL).

Each step must log a post-sync difference within the tolerance and finite mismatch metrics, and
placement.json must show the engine on the GPUs the placement promises. The CPU contract twin,
tests/rollout/test_gpu_run_arguments.py, builds these runs' configs and constructs each engine with
exactly the arguments the trainer would give it, against the API snapshot of the pinned wheel.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

STEPS = 3
# Arguments the engines need here beyond rlmega's own fields: eager mode (no CUDA graphs to capture for a
# 3-step run); SGLang's seeded sampling needs deterministic inference, with an attention backend that has it.
ENGINE_KWARGS = {
    "vllm": {"enforce_eager": "true"},
    "sglang": {"disable_cuda_graph": "true", "enable_deterministic_inference": "true", "attention_backend": "triton",
               "sampling_backend": "pytorch"},
}
PLACEMENTS = {
    "colocated": ["rollout.placement=colocated", "rollout.gpus_per_engine=0"],
    "disaggregated": ["rollout.placement=disaggregated", "rollout.gpus_per_engine=1"],
}


def run_overrides(backend: str, placement: str, run_dir: Path) -> list[str]:
    """The overrides of ``rlmega train --config tiny_cpu`` for one GPU run (also read by the CPU twin)."""
    return [f"run_dir={run_dir}", f"rollout.backend={backend}", *PLACEMENTS[placement], "cluster.gpus_per_rank=1",
            "layout.world_size=1", "layout.tp=1", f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=8",
            "rollout.n=4", "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
            "rollout.gpu_memory_utilization=0.3", "reward.num_workers=1",
            *(f"+rollout.engine_kwargs.{key}={value}" for key, value in ENGINE_KWARGS[backend].items())]


SHARDED_RDT = ["sync.transport=sharded_rdt"]  # vLLM's own transfer: the engine's workers pull their slices


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("backend", sorted(ENGINE_KWARGS))
def test_three_grpo_steps_on_gpu(tmp_path, backend, placement):
    pytest.importorskip(backend)
    _three_steps(tmp_path, backend, placement)


def test_three_grpo_steps_with_vllm_sharded_rdt(tmp_path):
    """The same run, colocated, with the weights through vLLM's sharded_rdt backend (ShardedSync): the post-sync
    check after every step shows the pulled weights are the trained ones. Needs Ray >= 2.56 with NIXL."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl", reason="vLLM's sharded_rdt pulls over Ray's NIXL tensor transport")
    _three_steps(tmp_path, "vllm", "colocated", *SHARDED_RDT)


def _three_steps(tmp_path, backend: str, placement: str, *more: str) -> None:
    gpus = torch.cuda.device_count()
    if gpus < (2 if placement == "disaggregated" else 1):
        pytest.skip(f"{placement} needs {2 if placement == 'disaggregated' else 1} GPUs, this machine has {gpus}")
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu", "tiny_assets=true",
               *run_overrides(backend, placement, tmp_path / "run"), *more]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert 0 <= row["sync/max_logprob_diff"] <= 0.5, row  # the bf16 tolerance, RLConfig.post_sync_atol
        assert math.isfinite(row["mismatch/abs_log_prob_diff_max"]) and math.isfinite(row["actor/pg_loss"]), row
    placed = json.loads((tmp_path / "run" / "placement.json").read_text())
    (rank,), (engine,) = placed["training_ranks"], placed["engines"]
    assert rank["gpus"], placed  # Ray gave the rank a GPU
    if placement == "colocated":
        assert engine["gpus"] == rank["gpus"], placed  # the engine runs on the rank's GPU, not on GPU 0 by chance
    else:
        assert engine["gpus"] and engine["gpus"] != rank["gpus"], placed

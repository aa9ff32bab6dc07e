"""An end-to-end GRPO run of configs/tiny_cpu_agent.yaml (real Megatron ranks, the transformers engine, Ray):
tool calls happen in every trajectory, their tokens are masked, and the policy update runs."""

import json
import subprocess
import sys
from pathlib import Path

from rlmega.trainer.assets import prepare_tiny_assets

HERE = Path(__file__).resolve().parent


def test_tiny_agent_run_calls_tools_and_updates(tmp_path):
    run_dir = tmp_path / "run"
    prepare_tiny_assets(run_dir / "assets", num_train=64, num_val=16)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu_agent", f"run_dir={run_dir}",
               "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
               "trainer.val_every=2", "trainer.val_prompts=4", "trainer.save_every=0", "export_hf=false",
               "layout.tp=1", "layout.world_size=1", f"agent.parser={HERE / 'agent_parts.py'}:always_calculate"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "step" in row and not any(key.startswith("val/") for key in row)]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["agent/tool_calls"] > 0 and row["agent/masked_tokens"] > 0
        assert row["agent/turns_mean"] > 1
        assert 0 < row["agent/masked_token_fraction"] < 1 and "actor/pg_loss" in row
        # The trainer's log-probs of the policy's tokens match the engine's (tool tokens are masked out).
        assert row["mismatch/abs_log_prob_diff_max"] < 1e-3
        assert row["sync/max_logprob_diff"] < 1e-3
    assert any(row["actor/grad_norm"] > 0.01 for row in steps)  # some group's answers differ: a real update
    assert any("val/accuracy" in row for row in rows)

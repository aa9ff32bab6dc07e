"""GRPO trained through the gateway: ``gateway.enabled`` has every response made by a harness that talks to the
policy with the real ``openai`` client (``rlmega.gateway.examples.single_turn``). The run trains, syncs, and the
engine's log-probs the gateway recorded match the trainer's on the same ids (the mismatch metric); the config check
refuses the combinations that cannot work, in one line each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
        "trainer.save_every=0", "export_hf=false", "reward.num_workers=1", "layout.tp=1", "layout.world_size=1"]
HARNESS = ["gateway.enabled=true", "gateway.harness=rlmega.gateway.examples:single_turn"]


def _train(run_dir, assets, *overrides, timeout_s=300):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *TINY, *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


@pytest.mark.timeout(400)
def test_grpo_trains_through_the_gateway(tmp_path, assets):
    result = _train(tmp_path / "run", assets, *HARNESS, "trainer.total_steps=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["sync/max_logprob_diff"] < 1e-3
        # What the gateway recorded is what the engine computed on the ids the trainer scores.
        assert row["mismatch/abs_log_prob_diff_max"] < 1e-3


@pytest.mark.timeout(400)
def test_a_harness_that_crashes_loses_only_its_sessions(tmp_path, assets):
    harness = f"{Path(__file__).parent / 'lossy_harness.py'}:run"
    result = _train(tmp_path / "run", assets, "gateway.enabled=true", f"gateway.harness={harness}",
                    "trainer.total_steps=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "actor/pg_loss" in line]
    # The first of each prompt's 4 sessions crashes and trains nothing; the other 12 train.
    assert row["gateway/lost_sessions"] == 4 and row["gateway/lost_session_fraction"] == 0.25
    assert row["gateway/calls_mean"] == 0.75


@pytest.mark.parametrize("overrides, message", [
    (["gateway.enabled=true"], "gateway.harness: a harness is needed"),
    ([*HARNESS, "agent.enabled=true"], "agent.enabled must be false"),
    ([*HARNESS, "gateway.host=0.0.0.0"], "give it a token"),
    (["gateway.enabled=true", "gateway.harness=nowhere.py:run"], "gateway.harness=nowhere.py:run: file not found"),
])
def test_the_config_check_refuses_what_cannot_work(tmp_path, assets, overrides, message):
    result = _train(tmp_path / "run", assets, *overrides, "trainer.total_steps=1", timeout_s=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr

"""End-to-end runs scored by a reward model (``configs/tiny_cpu_rm.yaml``) through ``rlmega train``: GRPO
with the reward model and a generative judge whose parser mostly raises (counted, the run goes on),
PPO with a critic, and asynchronous rollouts (the producer thread scores); the reward model's ranks and
the judge's engines are placed on their own, and validation is scored by the rule."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.tiny_reward_model import prepare_tiny_reward_model

SHORT = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=2",
         "trainer.val_prompts=8", "trainer.save_every=2", "export_hf=false", "reward.num_workers=1",
         "trainer.total_steps=2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    directory = tmp_path_factory.mktemp("assets")
    paths = prepare_tiny_assets(directory, num_train=64, num_val=16)
    # A few steps: these runs check the wiring, not what the reward model learnt.
    prepare_tiny_reward_model(directory / "reward_model", policy_dir=paths["model"], train_files=[paths["train"]],
                              steps=10, prompts_per_step=8)
    return directory


def _train(run_dir: Path, assets: Path, *overrides, timeout_s=400):
    run_dir.mkdir(parents=True)
    (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu_rm", f"run_dir={run_dir}",
               *SHORT, *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    placement = json.loads((run_dir / "placement.json").read_text())
    training = [row for row in rows if not any(key.startswith("val/") for key in row)]
    return training, [row for row in rows if "val/accuracy" in row], placement, result.stdout + result.stderr


def test_grpo_with_a_reward_model_and_a_judge(tmp_path, assets):
    parser = tmp_path / "parse.py"
    parser.write_text("def parse(text):\n    return float(text.strip())\n")  # the random judge rarely answers a number
    rows, validations, placement, output = _train(
        tmp_path / "run", assets, "layout.tp=1", "layout.world_size=1", "judge.enable=true",
        f"judge.path={assets / 'model'}", "judge.prompt_template='{question} {response}'", "judge.response_length=3",
        f"judge.parser={parser}:parse", "+reward.weights.judge=0.5")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # The policy trains on the combination: reward model + 0.5 judge (the rule is only watched).
        assert row["critic/score/mean"] == pytest.approx(row["reward/mean"], abs=1e-5)
        assert row["reward/mean"] == pytest.approx(row["reward/reward_model/mean"] + 0.5 * row["reward/judge/mean"],
                                                   abs=1e-5)
        assert "reward/rule/mean" in row and row["timing_s/reward_model"] > 0 and row["timing_s/judge"] > 0
        assert row["reward/reward_model/errors"] == 0
    assert sum(row["reward/judge/errors"] for row in rows) > 0  # parser failures counted, the run went on
    assert "judge scores failed and scored 0" in output
    assert [v["step"] for v in validations] == [0, 2] and all(0 <= v["val/accuracy"] <= 1 for v in validations)
    assert len(placement["reward_model_ranks"]) == 1 and len(placement["judge_engines"]) == 1


def test_ppo_with_a_reward_model(tmp_path, assets):
    rows, validations, placement, _ = _train(tmp_path / "run", assets, "algo=ppo", "rollout.placement=disaggregated",
                                             "reward_model.normalize=batch", "reward_model.clip_range=[-1.5,1.5]")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert "critic/vf_loss" in row and "actor/pg_loss" in row
        # batch z-scores of the reward model, clipped
        assert -1.5 <= row["critic/score/min"] < row["critic/score/max"] <= 1.5
        assert abs(row["critic/score/mean"]) < 0.5 and row["reward/reward_model/raw_mean"] != row["critic/score/mean"]
        assert "reward/judge/mean" not in row
    assert len(placement["reward_model_ranks"]) == 1 and "judge_engines" not in placement


def test_async_rollouts_score_with_the_reward_model_from_the_producer_thread(tmp_path, assets):
    rows, _, placement, _ = _train(tmp_path / "run", assets, "rollout.mode=async", "rollout.placement=disaggregated",
                                   "layout.tp=1", "layout.world_size=1", "trainer.val_every=0")
    assert [row["step"] for row in rows] == [1, 2]
    # A step reports the reward metrics of the last group scored since the previous step, if any.
    scored = [row for row in rows if "reward/reward_model/mean" in row]
    assert scored and all(row["reward/reward_model/errors"] == 0 for row in scored)
    for row in rows:
        assert -3.0 <= row["critic/score/min"] <= row["critic/score/max"] <= 3.0  # the config's clip
    assert len(placement["reward_model_ranks"]) == 1

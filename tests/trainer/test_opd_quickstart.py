"""The on-policy distillation quickstart (``configs/tiny_cpu_opd.yaml``) through ``rlmega train``, two short steps:
the teacher's rank scores every step's responses (its top-k into the actor's loss), and the distillation metrics
come out finite, the student's KL to the teacher positive."""

import json
import math
import subprocess
import sys

import pytest

from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.tiny_teacher import prepare_tiny_teacher

SHORT = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
         "trainer.save_every=0", "export_hf=false", "metrics.plot=false", "trainer.total_steps=2"]
DISTILL_METRICS = ("distill/teacher_kl", "distill/teacher_kl_k3", "distill/teacher_logp", "distill/top_k_kl",
                   "distill/top_k_loss_term", "timing_s/teacher")


@pytest.mark.timeout(300)
def test_the_opd_quickstart_distills_from_the_teacher_on_its_own_ranks(tmp_path):
    assets = tmp_path / "run" / "assets"
    paths = prepare_tiny_assets(assets, num_train=64, num_val=16)
    # A few steps: this run checks the wiring; the config's set-up finds the teacher and trains none.
    prepare_tiny_teacher(assets / "teacher", policy_dir=paths["model"], train_files=[paths["train"]], steps=10,
                         batch_size=8)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu_opd",
               f"run_dir={tmp_path / 'run'}", *SHORT]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained the tiny teacher" not in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    training = [row for row in rows if not any(key.startswith("val/") for key in row)]
    assert [row["step"] for row in training] == [1, 2]
    for row in training:
        assert all(math.isfinite(row[name]) for name in DISTILL_METRICS), row
        assert row["distill/teacher_kl"] > 0 and row["distill/teacher_kl_k3"] > 0 and row["distill/teacher_logp"] < 0
        assert row["distill/top_k_kl"] > 0 and row["timing_s/teacher"] > 0
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert len(placement["teacher_ranks"]) == 1

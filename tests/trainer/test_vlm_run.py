"""The vision-language quickstart config end to end on Ray: a tiny Qwen2.5-VL warm-starts and trains with GRPO on
image prompts (naming a square's colour), the engine's log-probs of image prompts equal the trainer's after every sync
(the acceptance bound 1e-5; fp32 CPU gives ~1e-6), the tower is trained when unfrozen, and the HF export holds every
tensor of the checkpoint and its image processor."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlmega.trainer.vlm_assets import prepare_tiny_vlm_assets

MISMATCH_BOUND = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vlm_assets")
    prepare_tiny_vlm_assets(directory, num_train=64, num_val=16)
    return directory


def test_the_vlm_quickstart_trains_on_images(tmp_path, assets):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu_vlm", f"run_dir={run_dir}",
               "trainer.total_steps=2", "trainer.sft_steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
               "trainer.val_every=2", "trainer.val_prompts=8", "trainer.save_every=0", "reward.num_workers=1",
               "rollout.placement=disaggregated", "rollout.temperature=0.7"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "mismatch/abs_log_prob_diff_max" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["mismatch/abs_log_prob_diff_max"] < MISMATCH_BOUND
        assert row["sync/max_logprob_diff"] < MISMATCH_BOUND
    assert any("val/accuracy" in row for row in rows)
    exported = load_file(str(run_dir / "hf" / "model-00001-of-00001.safetensors"))
    original = load_file(str(assets / "model" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert not torch.equal(exported["visual.merger.mlp.0.weight"], original["visual.merger.mlp.0.weight"])
    assert (run_dir / "hf" / "preprocessor_config.json").is_file()

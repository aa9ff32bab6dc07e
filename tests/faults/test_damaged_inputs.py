"""A run's broken input stops it with one line naming the file, the line where there is one, and the error: a reward
function file that fails to import, a damaged safetensors shard of the model, a torn checkpoint on resume."""

import json
import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file, save_file

from fault_helpers import ONE_RANK, TINY

NUM_SHARDS = 3


def _train(run_dir, assets, *overrides, env=None):
    """``rlmega train`` on the tiny config in one process (no Ray), as a user starts it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "assets").exists():
        (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli", "train", f"run_dir={run_dir}", *TINY, *ONE_RANK,
               "cluster.in_process=auto", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def _one_line(result, code: int) -> str:
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("rlmega train: "), result.stderr[-3000:]
    return result.stderr


def test_a_reward_file_that_fails_to_import(tmp_path, assets):
    reward = tmp_path / "my_reward.py"
    reward.write_text("import math\nimport not_a_module_here\n\n\ndef score(**kwargs):\n    return 1.0\n")
    run_dir = tmp_path / "run"
    line = _one_line(_train(run_dir, assets, "trainer.total_steps=1", f"reward.user_function={reward}:score"), 2)
    assert f"{reward} line 2: ModuleNotFoundError: No module named 'not_a_module_here'" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["assets"]


def test_a_damaged_shard_of_the_model_is_named_before_anything_starts(tmp_path, assets):
    model = tmp_path / "sharded-model"
    shutil.copytree(assets / "model", model)
    tensors = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names, weight_map = sorted(tensors), {}
    for shard in range(NUM_SHARDS):
        file = f"model-{shard + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        save_file({name: tensors[name] for name in names[shard::NUM_SHARDS]}, model / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[shard::NUM_SHARDS], file))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    damaged = model / f"model-00002-of-{NUM_SHARDS:05d}.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    run_dir = tmp_path / "run"
    line = _one_line(_train(run_dir, assets, "trainer.total_steps=1", f"model.path={model}"), 2)
    assert f"model.path: {damaged} is damaged (" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["assets"]


def test_a_torn_checkpoint_is_named_on_resume(tmp_path, assets):
    run_dir = tmp_path / "run"
    finished = _train(run_dir, assets, "trainer.total_steps=1")
    assert finished.returncode == 0, finished.stderr[-3000:]
    torn = run_dir / "checkpoints" / "actor" / "iter_0000001" / "__0_0.distcp"
    torn.write_bytes(b"\0" * torn.stat().st_size)  # the right size, garbled
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    line = _one_line(_train(run_dir, assets, "trainer.total_steps=2", env={"TMPDIR": str(scratch)}), 1)
    assert f"{torn} is damaged (" in line and "Traceback" not in line
    assert list(scratch.glob("rlmega-*")) == []  # the failed start's logs stay in the run directory

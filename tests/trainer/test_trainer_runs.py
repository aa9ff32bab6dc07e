"""End-to-end trainer runs on the tiny CPU config: each algorithm and both placements run, a dead
engine stops the run with its name, a failing reward function does not, and a run killed with
SIGKILL resumes to exactly the metrics of an uninterrupted one."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlmega.config import load_config

TINY = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
        "trainer.save_every=1", "export_hf=false", "sync.post_sync_check=true", "reward.num_workers=1"]
ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC = {"timing_s/", "perf/", "sync/gbps", "actor/perf", "critic/perf"}


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


def _prepare(run_dir: Path, assets: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "assets").exists():
        (run_dir / "assets").symlink_to(assets)


def _train(run_dir, assets, *overrides, timeout_s=300, env=None):
    _prepare(run_dir, assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *TINY, *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          env=None if env is None else {**os.environ, **env})


def kill_after_checkpoint(process: subprocess.Popen, tracker: Path, checkpoint: int, total: int) -> int:
    """SIGKILL ``process``'s session (the driver and the Ray processes it started) at the first look that finds
    checkpoint ``checkpoint`` or a later one written (a fast machine may be a step further by then); the checkpoint
    it died at, asserted to be mid-run (before ``total``)."""

    def checkpointed() -> int:
        text = tracker.read_text().strip() if tracker.exists() else ""
        return int(text) if text.isdigit() else 0

    deadline = time.monotonic() + 240
    while checkpointed() < checkpoint and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it was killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    killed_at = checkpointed()
    assert checkpoint <= killed_at < total, f"the run was killed at checkpoint {killed_at}, not mid-run"
    return killed_at


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if not any(key.startswith("val/") for key in row)]


def _comparable(row):
    return {key: value for key, value in row.items() if not any(key.startswith(prefix) for prefix in DETERMINISTIC)}


@pytest.mark.parametrize("overrides", [
    # Offloading moves nothing on CPU, so colocated runs skip it there; this one does it all the same.
    ["algo=grpo", "rollout.placement=colocated", "rollout.colocated_offload=always", "trainer.total_steps=2",
     "rollout.temperature=0.7"],
    ["algo=dapo", "rollout.placement=disaggregated", "rollout.num_engines=2", "trainer.total_steps=2"],
    ["algo=ppo", "rollout.placement=disaggregated", "trainer.total_steps=2"],
    # Every training rank sends its own blocks to the engines (no gather to rank 0).
    ["algo=grpo", "rollout.placement=disaggregated", "rollout.num_engines=2", "sync.transport=sliced",
     "trainer.total_steps=2"],
    ["algo=reinforce_plus_plus", "trainer.total_steps=1", "layout.tp=1"],
    ["algo=rloo", "trainer.total_steps=1", "layout.tp=1", "layout.world_size=1"],
    ["algo=grpo", "trainer.total_steps=1", "layout.tp=1", "layout.cp=2"],
    ["algorithm.adv_estimator=remax", "actor.policy_loss.name=sapo", "trainer.total_steps=1", "layout.tp=1",
     "layout.world_size=1"],
], ids=["grpo-colocated-t0.7", "dapo-disaggregated-2-engines", "ppo-critic", "grpo-sliced-2-engines", "reinforce++", "rloo", "grpo-cp2",
        "remax-sapo"])
def test_algorithms_and_placements_run(tmp_path, assets, overrides):
    result = _train(tmp_path / "run", assets, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    steps = int(next(o for o in overrides if o.startswith("trainer.total_steps")).split("=")[1])
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert "actor/pg_loss" in row and "critic/score/mean" in row and "timing_s/gen" in row
        assert row["sync/max_logprob_diff"] < 1e-3  # the engines serve the trained weights
        # The trainer scores the sampled batch under the distribution the engine sampled it from.
        assert row["mismatch/abs_log_prob_diff_max"] < 1e-3  # fp32 kernels differ by ~1e-5, rarely 1e-4
    if "algo=ppo" in overrides:
        assert "critic/vf_loss" in rows[-1]
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert len(placement["engines"]) == (2 if "rollout.num_engines=2" in overrides else 1)
    assert (tmp_path / "run" / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt").read_text() == str(steps)


def test_killed_run_resumes_to_the_same_metrics(tmp_path, assets):
    steps = ["trainer.total_steps=4", "layout.tp=1", "layout.world_size=1", "trainer.max_checkpoints_to_keep=2"]
    reference = _train(tmp_path / "straight", assets, *steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kept = sorted(p.name for p in (tmp_path / "straight" / "checkpoints" / "actor").glob("iter_*"))
    assert kept == ["iter_0000003", "iter_0000004"]  # saved every step, the newest two kept
    run_dir = tmp_path / "killed"
    _prepare(run_dir, assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *TINY, *steps]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tracker = run_dir / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt"
    kill_after_checkpoint(process, tracker, 2, total=4)
    resumed = _train(run_dir, assets, *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    expected, got = _rows(tmp_path / "straight"), _rows(run_dir)
    assert [row["step"] for row in got] == [1, 2, 3, 4]
    for want, have in zip(expected, got):
        assert _comparable(have) == pytest.approx(_comparable(want), rel=1e-5, abs=1e-6), have["step"]


def test_dead_engine_stops_the_run_naming_it(tmp_path, assets):
    import ray

    from rlmega.trainer.build import build_trainer
    from rlmega.trainer.remote import WorkerFailure

    _prepare(tmp_path, assets)
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", *TINY, "layout.tp=1", "layout.world_size=1",
                                      "rollout.placement=disaggregated", "cluster.timeout_s=60"])
    trainer = build_trainer(config)
    try:
        # The private cluster keeps only the last task events (a long run's GCS grew without it: benchmarks/soak.py).
        assert ray._config.task_events_max_num_task_in_gcs() == 1000
        ray.kill(trainer.engines.actors[0])
        started = time.monotonic()
        with pytest.raises(WorkerFailure, match="rollout engine 0 died") as failure:
            trainer.train_step(1)
        assert time.monotonic() - started < 60
        message = str(failure.value)
        assert "\n" not in message and message.endswith(f"its output is in {tmp_path}/logs/workers/rollout-engine-0.log")
    finally:
        trainer.close()
        ray.shutdown()


def test_reward_function_that_raises_or_hangs_does_not_stop_training(tmp_path, assets):
    function = tmp_path / "reward.py"
    function.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str.startswith('1'):\n"
        "        time.sleep(3600)\n"
        "    if len(solution_str) % 2:\n"
        "        raise ValueError('bad answer')\n"
        "    return float(solution_str.strip() == str(ground_truth))\n"
    )
    result = _train(tmp_path / "run", assets, "trainer.total_steps=2", "layout.tp=1", "layout.world_size=1",
                    f"reward.user_function={function}:compute_score", "reward.timeout_s=1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert len(rows) == 2
    assert sum(row.get("reward/errors", 0) for row in rows) > 0


def test_sft_command_trains_and_exports_an_hf_model(tmp_path, assets):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _prepare(tmp_path, assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "sft", f"run_dir={tmp_path}", "trainer.sft_steps=3",
               "trainer.prompts_per_step=4", "rollout.n=4", "layout.tp=1", "layout.world_size=1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = tmp_path / "sft_hf"
    AutoModelForCausalLM.from_pretrained(exported)  # a complete HF directory
    before, after = load_file(str(assets / "model" / "model.safetensors")), {}
    for shard in exported.glob("*.safetensors"):
        after.update(load_file(str(shard)))
    assert after.keys() == before.keys()
    assert not all(torch.equal(after[name], before[name]) for name in before)  # the warm-start trained it


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, assets):
    run_dir = tmp_path / "run"
    _prepare(run_dir, assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *TINY,
               "trainer.total_steps=50", "trainer.save_every=0", "layout.tp=1", "layout.world_size=1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, output[-3000:]
    saved = re.search(r"preempted: checkpoint saved at step (\d+)", output)
    assert saved, output[-3000:]
    tracker = run_dir / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text() == saved.group(1) and int(saved.group(1)) < 50


def test_perturbed_engine_raises_the_mismatch_and_masked_is_masks_tokens(tmp_path, assets):
    one_rank = ["trainer.total_steps=2", "layout.tp=1", "layout.world_size=1",
                "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=1.2"]
    exact = _train(tmp_path / "exact", assets, *one_rank)
    assert exact.returncode == 0, exact.stderr[-3000:]
    # The engine serves the trained weights plus noise: the post-sync check would stop such a run.
    noisy = _train(tmp_path / "noisy", assets, *one_rank, "+rollout.engine_kwargs.weight_noise_std=0.05",
                   "sync.post_sync_check=false", "algorithm.rollout_correction.rollout_is=token")
    assert noisy.returncode == 0, noisy.stderr[-3000:]
    for clean, perturbed in zip(_rows(tmp_path / "exact"), _rows(tmp_path / "noisy")):
        assert clean["mismatch/abs_log_prob_diff_max"] < 1e-3 and clean["mismatch/masked_token_fraction"] == 0.0
        assert perturbed["mismatch/abs_log_prob_diff_mean"] > 100 * max(clean["mismatch/abs_log_prob_diff_mean"], 1e-6)
        assert 0.0 < perturbed["mismatch/masked_token_fraction"] < 1.0
        assert perturbed["rollout_corr/rollout_is_mean"] != 1.0


def test_bypass_mode_corrects_inside_the_loss(tmp_path, assets):
    run = _train(tmp_path / "bypass", assets, "trainer.total_steps=2", "layout.tp=1", "layout.world_size=1",
                 "+rollout.engine_kwargs.weight_noise_std=0.05", "sync.post_sync_check=false",
                 "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
                 "algorithm.rollout_correction.rollout_rs=token_k1",
                 "algorithm.rollout_correction.rollout_rs_threshold=1.2",
                 "actor.policy_loss.name=reinforce")
    assert run.returncode == 0, run.stderr[-3000:]
    for row in _rows(tmp_path / "bypass"):  # the update's metrics: the trained policy against the noisy engine
        assert 0.0 < row["rollout_corr/rollout_rs_masked_fraction"] < 1.0
        assert row["rollout_corr/rollout_is_mean"] != 1.0
        assert math.isclose(row["mismatch/masked_token_fraction"], row["rollout_corr/rollout_rs_masked_fraction"])


def test_the_quickstart_starts_from_a_verl_config(tmp_path, assets):
    run_dir = tmp_path / "run"
    _prepare(run_dir, assets)
    verl_overrides = ["trainer.total_training_steps=1", "trainer.n_gpus_per_node=1",
                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "data.train_batch_size=4",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
                      "trainer.test_freq=0", "trainer.logger=[console]"]
    rlmega_overrides = [f"run_dir={run_dir}", "trainer.sft_steps=2", "export_hf=false", "reward.num_workers=1"]
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--from-verl", str(ROOT / "configs/verl/tiny_cpu_grpo.yaml"),
               *verl_overrides, *[f"--set={override}" for override in rlmega_overrides]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 1/1" in result.stdout and (run_dir / "checkpoints" / "actor" / "iter_0000001").is_dir()
    refused = subprocess.run([*command[:5], "actor_rollout_ref.model.lora_rank=8"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "actor_rollout_ref.model.lora_rank" in refused.stderr


def test_a_run_that_fails_to_start_leaves_the_run_directory_as_it_was_but_for_its_logs(tmp_path, assets):
    run_dir, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    # The untrained model answers nothing right, so dynamic sampling finds no group to train on in
    # step 1: the run fails after its parts started and its metrics file opened.
    result = _train(run_dir, assets, "trainer.total_steps=1", "layout.tp=1", "layout.world_size=1",
                    "trainer.sft_steps=0", "algorithm.dynamic_sampling=true", "algorithm.max_generation_rounds=1",
                    env={"TMPDIR": str(scratch)})
    assert result.returncode != 0 and "nothing to train on" in result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["assets", "logs"]  # no placement.json, no metrics.jsonl
    [kept] = (run_dir / "logs").iterdir()
    assert kept.name.startswith("failed-start-") and (kept / "workers" / "in-process.log").is_file()
    assert list(scratch.glob("rlmega-*")) == []  # nothing of the run outside its directory


def test_the_console_shows_rlmega_lines_and_workers_write_to_their_logs(tmp_path, assets):
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, "trainer.total_steps=1", "rollout.placement=disaggregated")
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in ("(RankProcess", "(HFEngine", "Warning", "Transformer Engine", "Loading weights", "INFO", "WARNING"):
        assert noise not in console, console[-3000:]
    assert "[step 1/1" in console
    logs = run_dir / "logs" / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["rollout-engine-0.log", "training-rank-0.log", "training-rank-1.log"]
    assert "Transformer Engine and Apex are not installed" in (logs / "training-rank-1.log").read_text()


def _tiny_moe_policy(directory: Path) -> Path:
    """The quickstart's tokenizer on a small Qwen3-MoE (4 experts, top-2): a MoE policy for the same task."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rlmega.data import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=64,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_moe_policy_trains_with_routing_replay(tmp_path, assets, replay):
    """R2 records in the old-log-prob pass, R3 in the engine; both update through two mini-batches."""
    model = _tiny_moe_policy(tmp_path / "moe")
    result = _train(tmp_path / "run", assets, f"model.path={model}", f"actor.router_replay={replay}",
                    "trainer.total_steps=2", "layout.tp=1", "layout.world_size=1", "actor.ppo_mini_batches=2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["actor/ppo_kl"]) for row in rows)

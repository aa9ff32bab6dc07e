"""The overlapping rollout modes on the real stack (Megatron rank, transformers engine, Ray): one-step-off
equals the same run with its rollouts generated in turn (bit for bit), the weight versions each step
trains on, and an asynchronous run killed with SIGKILL that resumes without losing or repeating a prompt."""

import json
import subprocess
import sys

import pytest

from rlmega.config import load_config
from trainer.test_trainer_runs import kill_after_checkpoint

ASYNC = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0", "export_hf=false",
         "reward.num_workers=1", "layout.tp=1", "layout.world_size=1", "rollout.placement=disaggregated",
         "cluster.timeout_s=120", "rollout.temperature=0.7"]
EXACT = ("timing_s/", "perf/", "sync/gbps", "actor/perf", "async/", "batch/generation", "critic/perf")


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


def _prepare(run_dir, assets):
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "assets").exists():
        (run_dir / "assets").symlink_to(assets)


def _rows(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_one_step_off_equals_its_rollouts_generated_in_turn(tmp_path, assets):
    import ray

    from rlmega.trainer.build import build_trainer

    def run(name, overlap):
        run_dir = tmp_path / name
        _prepare(run_dir, assets)
        config = load_config("tiny_cpu", [f"run_dir={run_dir}", *ASYNC, "trainer.total_steps=4",
                                          "rollout.mode=one_step_off", "trainer.save_every=0"])
        try:
            trainer = build_trainer(config)
            trainer.schedule.overlap = overlap
            assert trainer.fit() == 0
        finally:
            ray.shutdown()  # each run gets a Ray of its own, as a command-line run does
        return run_dir

    overlapped, in_turn = run("overlapped", True), run("in_turn", False)
    versions = [row["weight_versions"] for row in _rows(overlapped, "trained_prompts.jsonl")]
    assert versions == [[0], [0], [1], [2]]  # step k trains on responses of the weights step k-1 trained from
    assert _rows(overlapped, "trained_prompts.jsonl") == _rows(in_turn, "trained_prompts.jsonl")
    for a, b in zip(_rows(overlapped), _rows(in_turn), strict=True):
        exact = {k: v for k, v in a.items() if not k.startswith(EXACT)}
        assert exact == pytest.approx({k: b[k] for k in exact}, rel=1e-6, abs=1e-7), a["step"]
        assert a["sync/max_logprob_diff"] < 1e-3  # the engine serves the trained weights after each sync


def test_killed_async_run_resumes_without_losing_or_repeating_a_prompt(tmp_path, assets):
    steps = 6
    run_dir = tmp_path / "killed"
    _prepare(run_dir, assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *ASYNC,
               f"trainer.total_steps={steps}", "trainer.save_every=1", "rollout.mode=async", "rollout.max_staleness=1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tracker = run_dir / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt"
    killed_at = kill_after_checkpoint(process, tracker, 3, total=steps)  # mid-run: the buffer holds later steps' groups
    trained_before_kill = _rows(run_dir, "trained_prompts.jsonl")
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    rows = _rows(run_dir, "trained_prompts.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert rows[:killed_at] == trained_before_kill[:killed_at]  # what the checkpoint holds stays as it was
    trained = [index for row in rows for index in row["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained on twice"
    # No prompt lost: in the sampler's order, every prompt before the last one trained was trained, except
    # the few that were still being generated (at most the buffer's (max_staleness + 1) x prompts_per_step).
    from rlmega.data import StatefulSampler

    order = StatefulSampler(64, 4, seed=load_config("tiny_cpu", [f"run_dir={run_dir}", *ASYNC]).trainer.seed
                            ).epoch_order(0)
    last = max(order.index(index) for index in trained)
    missing = [index for index in order[:last] if index not in trained]
    assert len(missing) <= 2 * 4, missing
    for row in rows:
        assert row["step"] - 1 - min(row["weight_versions"]) <= 1  # the staleness bound, after the resume too

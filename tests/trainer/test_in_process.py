"""A run in one process (``cluster.in_process``): which runs qualify, the same metrics as the same run on Ray,
a console without library noise, and a failing part named on one line."""

import json
import subprocess
import sys

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.in_process import in_process_threads, rank_threads, runs_in_process

ONE_RANK = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
            "trainer.save_every=0", "export_hf=false", "reward.num_workers=1", "layout.tp=1", "layout.world_size=1"]
TIMINGS = ("timing_s/", "perf/", "sync/gbps", "actor/perf")


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


def _config(tmp_path, assets, *overrides, check=True):
    return load_config("tiny_cpu", [f"run_dir={tmp_path}", f"model.path={assets / 'model'}",
                                    f"data.files=['{assets / 'train.parquet'}']", *ONE_RANK, *overrides], check=check)


def test_which_runs_go_in_one_process(tmp_path, assets, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert runs_in_process(_config(tmp_path, assets))
    assert not runs_in_process(_config(tmp_path, assets, "cluster.in_process=never"))
    # Ranks 1..N-1 are the driver's children, each with its own cpus_per_rank threads.
    tp2 = _config(tmp_path, assets, "layout.world_size=2", "layout.tp=2", "cluster.cpus_per_rank=1")
    assert runs_in_process(tp2) and rank_threads(tp2) == 1
    for override, named in [("rollout.num_engines=2", "num_engines"),
                            ("rollout.placement=disaggregated", "placement"), ("cluster.gpus_per_rank=1", "GPUs"),
                            ("cluster.ray_address=auto", "Ray cluster")]:
        config = _config(tmp_path, assets, override, check=False)
        assert any(named in obstacle for obstacle in config.in_process_obstacles()), override
        assert not runs_in_process(config)
    # Only one of the two parts computes at a time: they share what each would hold on Ray, up to the machine's cores.
    config = _config(tmp_path, assets, "cluster.cpus_per_rank=0.5", "rollout.cpus_per_engine=0.5")
    assert in_process_threads(config) == 1


def test_always_refuses_a_run_that_cannot_run_in_one_process(tmp_path, assets):
    with pytest.raises(UserError, match=r"cluster.in_process: always, .*rollout.num_engines=2 .*rollout.placement="
                                        r"disaggregated .*cluster.in_process=auto"):
        _config(tmp_path, assets, "cluster.in_process=always", "rollout.num_engines=2", "rollout.placement=disaggregated")


def _train(run_dir, assets, *overrides):
    run_dir.mkdir(parents=True)
    (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *ONE_RANK, *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout", [[], ["layout.world_size=2", "layout.tp=2"]], ids=["one-rank", "tp2"])
def test_a_run_in_one_process_equals_the_same_run_on_ray(tmp_path, assets, layout):
    # One thread for every part on both sides (0.5 + 0.5 CPUs in one process), so that sums add up in the same order.
    # At TP2, rank 1 is the driver's child process, and the ranks' collectives and the export's gathers run between
    # the processes as between Ray's actors.
    same = ["trainer.total_steps=3", "cluster.cpus_per_rank=0.5", "rollout.cpus_per_engine=0.5", "sync.check_every=2",
            "algo=grpo", "trainer.val_every=2", "trainer.val_prompts=8", "trainer.save_every=2", *layout]
    alone, on_ray = (_train(tmp_path / name, assets, *same, f"cluster.in_process={mode}")
                     for name, mode in (("alone", "always"), ("on_ray", "never")))
    assert alone.returncode == 0 and on_ray.returncode == 0, alone.stderr[-3000:] + on_ray.stderr[-3000:]
    placements = [json.loads((tmp_path / name / "placement.json").read_text())["placement"]
                  for name in ("alone", "on_ray")]
    assert placements == ["in_process", "colocated"]
    rows, expected = _rows(tmp_path / "alone"), _rows(tmp_path / "on_ray")
    assert len(rows) == len(expected) == 6  # 3 steps; validation before the first and after steps 2 and 3
    for row, want in zip(rows, expected, strict=True):
        assert {k: v for k, v in row.items() if not k.startswith(TIMINGS)} == \
            pytest.approx({k: v for k, v in want.items() if not k.startswith(TIMINGS)}, rel=1e-6, abs=1e-7)
    checked = [row["step"] for row in rows if row.get("sync/max_logprob_diff", 1.0) < 1e-4]
    assert checked == [2]  # the post-sync check ran after every 2nd sync, and the engine served the trained weights
    steps = [(tmp_path / name / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt").read_text()
             for name in ("alone", "on_ray")]
    assert steps == ["3", "3"]


def test_the_console_stays_the_drivers_and_a_failing_part_is_named_on_one_line(tmp_path, assets):
    run_dir = tmp_path / "run"
    result = _train(run_dir, assets, "trainer.total_steps=1", "cluster.in_process=always")
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in ("Warning", "Transformer Engine", "Loading weights", "INFO", "WARNING"):
        assert noise not in console, console[-3000:]
    assert "[step 1/1" in console
    logs = run_dir / "logs" / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["in-process.log"]
    assert "Transformer Engine and Apex are not installed" in (logs / "in-process.log").read_text()

    # At TP2 rank 1 is a child process of the driver's, with a log of its own.
    tp2 = _train(tmp_path / "tp2", assets, "trainer.total_steps=1", "layout.world_size=2", "layout.tp=2",
                 "cluster.cpus_per_rank=1")
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    console = tp2.stdout + tp2.stderr
    for noise in ("Warning", "Transformer Engine", "Loading weights", "INFO", "WARNING"):
        assert noise not in console, console[-3000:]
    logs = tmp_path / "tp2" / "logs" / "workers"
    assert sorted(p.name for p in logs.iterdir()) == ["in-process.log", "training-rank-1.log"]
    assert "Transformer Engine and Apex are not installed" in (logs / "training-rank-1.log").read_text()

    # An engine that cannot start: the one line names it and what it was doing; the traceback is in the logs.
    broken = _train(tmp_path / "broken", assets, "trainer.total_steps=1", "cluster.in_process=always",
                    "+rollout.engine_kwargs.attn_implementation=no_such_attention")
    assert broken.returncode == 1
    assert broken.stderr.count("\n") == 1, broken.stderr[-3000:]
    assert broken.stderr.startswith("rlmega train: starting engines: rollout engine 0 raised ")
    assert "Traceback" not in broken.stdout + broken.stderr

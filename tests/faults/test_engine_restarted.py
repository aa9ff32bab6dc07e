"""A rollout engine killed with SIGKILL mid-generation, with ``rollout.restart_dead_engines``: it is restarted in place,
given the current weights and checked, its requests are submitted again, and the run finishes having trained what a
run without the kill trains (no prompt twice, none lost); one death more than the budget fails the run naming it."""

import os
import re
import signal
import time

import pytest

from fault_helpers import ONE_RANK, _cmdline, _rows, wait_for

from rlmega.config import load_config
from rlmega.data import StatefulSampler

pytestmark = pytest.mark.timeout(300)

GENERATING = "ray::HFEngine.generate"
PROMPTS, N, STEPS = 4, 4, 6  # the tiny run's prompts_per_step and rollout.n (fault_helpers.TINY); steps of a run
# The post-sync check probes the engine with generate calls too: after the first sync it is left to the restarted
# engine's own check, so that a kill lands in a rollout request. Longer responses keep each generate call open
# long enough for the test to see it running.
RESTARTS = [*ONE_RANK, "rollout.restart_dead_engines=1", "sync.check_every=1000", "trainer.save_every=0",
            "rollout.max_new_tokens=16"]
MODES = {"sync": [], "async": ["rollout.mode=async", "rollout.placement=disaggregated"]}


def _kill_generating_engine(run, after_step: int, exclude: tuple[int, ...] = ()) -> int:
    """SIGKILL the engine's process as soon as it runs generate, once step ``after_step`` is done; its pid."""
    run.wait_step(after_step)
    engines = wait_for(lambda: [pid for pid in run.processes("ray::HFEngine") if pid not in exclude], 120,
                       "an engine process", run.process)
    run.wait_title(engines, GENERATING)
    victim = next(pid for pid in engines if _cmdline(pid) == GENERATING)
    os.kill(victim, signal.SIGKILL)
    return victim


def _trained_prompts(run_dir) -> list[list[int]]:
    import json

    return [json.loads(line)["prompts"] for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", MODES)
def test_engine_killed_mid_generation_is_restarted_and_the_run_trains_every_prompt_once(start_run, mode):
    run = start_run(mode, f"trainer.total_steps={STEPS}", *RESTARTS, *MODES[mode])
    _kill_generating_engine(run, after_step=1)
    assert run.process.wait(timeout=240) == 0, run.output()[-3000:]
    output = run.output()
    assert re.search(r"rollout engine 0 died \(.*\).*; restarting it in place \(restart 1 of at most 1 within 100 "
                     r"steps\)", output), output[-3000:]
    assert re.search(r"rollout engine 0 restarted: it serves the current weights, post-sync check passed", output)

    rows = _rows(run.run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert sum(row["rollout/engine_restarts"] for row in rows) == 1
    resubmitted = sum(row["rollout/resubmitted_requests"] for row in rows)
    if mode == "sync":
        assert resubmitted == PROMPTS * N  # the step's whole request, on the only engine
    else:
        assert 1 <= resubmitted <= 2 * PROMPTS * N  # what the engine held: at most the staleness bound's groups
    assert all(row["batch/num_sequences"] == PROMPTS * N for row in rows)  # none dropped, none twice

    trained = _trained_prompts(run.run_dir)
    seed = load_config("tiny_cpu", [f"run_dir={run.run_dir}"], check=False).trainer.seed
    order = StatefulSampler(64, PROMPTS, seed=seed).epoch_order(0)
    if mode == "sync":  # exactly the prompts of a run without the kill, step by step
        assert trained == [order[PROMPTS * step:PROMPTS * (step + 1)] for step in range(STEPS)]
    else:
        flat = [index for prompts in trained for index in prompts]
        assert len(flat) == len(set(flat)) == STEPS * PROMPTS, trained  # no prompt trained twice
        # None lost: in the sampler's order, every prompt before the last one trained was trained, but for those
        # still in the buffer or in flight at the end (at most (max_staleness + 1) x prompts_per_step).
        last = max(order.index(index) for index in flat)
        assert len([index for index in order[:last] if index not in flat]) <= 2 * PROMPTS, trained


def test_engine_that_dies_more_often_than_allowed_fails_the_run_naming_it(start_run):
    run = start_run("run", "trainer.total_steps=30", *RESTARTS)
    first = _kill_generating_engine(run, after_step=1)
    run.wait_for_output("restarted: it serves the current weights")
    run.snapshot()
    _kill_generating_engine(run, after_step=run.last_step(), exclude=(first,))
    killed = time.monotonic()
    wait_for(lambda: run.process.poll() is not None, 60, "the run to fail after the second kill")
    output = run.output()
    assert run.process.returncode == 1, output[-3000:]
    assert re.search(r"rlmega train: .*rollout engine 0 died \(.*\).*; it had been restarted 1 time\(s\) within the "
                     r"last 100 steps, as many as rollout.restart_dead_engines=1 allows", output), output[-3000:]
    print(f"second kill: the run failed {time.monotonic() - killed:.1f} s later")
    run.assert_nothing_left()

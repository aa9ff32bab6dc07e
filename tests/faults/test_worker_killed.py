"""A worker of a running job killed with SIGKILL mid-step. A training rank or the rollout engine: the job fails
within a minute with a message naming what died, and leaves no process behind. A reward worker: the pool
replaces it, as documented (``rlmega/rewards/pool.py``): its call scores 0 as an error and the run goes on."""

import os
import re
import signal
import time

import pytest

from fault_helpers import _cmdline, wait_for

pytestmark = pytest.mark.timeout(300)

FAIL_WITHIN_S = 60.0


@pytest.mark.parametrize("title, named", [
    ("ray::RankProcess.update", r"training rank [01]"),  # which rank a pid is Ray does not show; either names itself
    ("ray::HFEngine.generate", r"rollout engine 0"),
], ids=["training-rank", "rollout-engine"])
def test_killed_worker_fails_the_job_naming_it(start_run, title, named):
    # Two ranks at TP=2: when one dies in the update, the other is blocked in a collective with it.
    run = start_run("run", "trainer.total_steps=30", "layout.world_size=2", "layout.tp=2")
    candidates = run.processes(title.split(".")[0])
    run.wait_step(1)
    run.wait_title(candidates, title)
    victim = next((pid for pid in candidates if _cmdline(pid) == title), candidates[0])
    run.snapshot()
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: run.process.poll() is not None, FAIL_WITHIN_S, f"the job to fail after {title} was killed")
    took = time.monotonic() - killed
    output = run.output()
    assert run.process.returncode not in (0, 143), output[-3000:]
    assert re.search(named + r".{0,40}\bdied\b", output), output[-3000:]
    assert took < FAIL_WITHIN_S
    print(f"{title} killed: the job failed {took:.1f} s later")
    run.assert_nothing_left()


def test_killed_reward_worker_is_replaced_and_the_run_goes_on(start_run, tmp_path):
    started, release = tmp_path / "scoring", tmp_path / "release"
    function = tmp_path / "reward.py"
    function.write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    if not os.path.exists({str(release)!r}):\n"
        f"        open({str(started)!r}, 'w').close()\n"
        "        time.sleep(120)  # the first call hangs until the test kills its worker\n"
        "    return float(solution_str.strip() == str(ground_truth))\n"
    )
    run = start_run("run", "trainer.total_steps=3", "layout.world_size=1", "layout.tp=1",
                    f"reward.user_function={function}:compute_score", "reward.timeout_s=200")
    wait_for(started.exists, 240, "the first reward call", run.process)
    workers = [pid for pid in run.processes("") if "rlmega.rewards._worker" in _cmdline(pid)]
    assert len(workers) == 1, workers
    release.touch()
    run.snapshot()
    os.kill(workers[0], signal.SIGKILL)
    assert run.process.wait(timeout=240) == 0, run.output()[-3000:]
    rows = run.new_rows()
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[0]["reward/errors"] == 1.0  # the killed call, scored 0
    assert all(row["reward/errors"] == 0.0 for row in rows[1:])  # its replacement scores the rest
    run.assert_nothing_left()

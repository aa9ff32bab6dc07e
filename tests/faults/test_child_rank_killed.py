"""A TP2 run without Ray (``cluster.in_process``: rank 0 and the engine in the driver, rank 1 its child process):
a killed child rank fails the job within a minute naming it, and a killed driver takes its child rank with it.
Either way no process of the run is left."""

import os
import re
import signal
import time

import pytest

from fault_helpers import _cmdline, wait_for

pytestmark = pytest.mark.timeout(300)

FAIL_WITHIN_S = 60.0
TP2_WITHOUT_RAY = ["trainer.total_steps=30", "layout.world_size=2", "layout.tp=2", "cluster.in_process=always"]


def _child_rank(run) -> int:
    return wait_for(lambda: next((pid for pid in run.processes("") if "rlmega.trainer.local_ranks" in _cmdline(pid)),
                                 None), 240, "the child rank's process", run.process)


def test_killed_child_rank_fails_the_job_naming_it(start_run):
    run = start_run("run", *TP2_WITHOUT_RAY)
    run.wait_step(1)
    child = _child_rank(run)
    run.snapshot()
    os.kill(child, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: run.process.poll() is not None, FAIL_WITHIN_S, "the job to fail after its child rank was killed")
    took = time.monotonic() - killed
    output = run.output()
    assert run.process.returncode not in (0, 143), output[-3000:]
    # Rank 0, in a collective with it or not, is not the one named: the dead rank is.
    assert re.search(r"training rank 1 died \(killed by signal SIGKILL\); its output is in \S+training-rank-1\.log",
                     output), output[-3000:]
    assert took < FAIL_WITHIN_S
    print(f"child rank killed: the job failed {took:.1f} s later")
    run.assert_nothing_left()


def test_killed_driver_takes_its_child_rank(start_run):
    run = start_run("run", *TP2_WITHOUT_RAY)
    run.wait_step(1)
    _child_rank(run)
    run.kill_driver()  # remembers the run's processes first
    run.assert_nothing_left()

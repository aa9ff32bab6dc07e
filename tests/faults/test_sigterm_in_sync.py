"""SIGTERM (a preemption) landing while the weights are being synced into the engine: the step still finishes,
its checkpoint is written, the driver exits with 143, and nothing of the run is left."""

import re
import signal

import pytest

from fault_helpers import ONE_RANK, wait_for

pytestmark = pytest.mark.timeout(300)


def test_sigterm_during_the_weight_sync_finishes_the_step_and_checkpoints(start_run):
    run = start_run("run", "trainer.total_steps=40", "trainer.save_every=0", *ONE_RANK)
    ranks = run.processes("ray::RankProcess")
    run.wait_step(2)
    run.wait_title(ranks, "ray::RankProcess.push_weights")  # the sync at the end of a step after step 2
    interrupted = run.last_step() + 1  # its metrics row comes after the sync
    run.snapshot()
    run.process.send_signal(signal.SIGTERM)
    wait_for(lambda: run.process.poll() is not None, 120, "the run to stop after SIGTERM")
    output = run.output()
    assert run.process.returncode == 143, output[-3000:]
    saved = re.search(r"preempted: checkpoint saved at step (\d+)", output)
    assert saved and int(saved.group(1)) == interrupted, output[-3000:]
    actor = run.run_dir / "checkpoints" / "actor"
    assert (actor / "latest_checkpointed_iteration.txt").read_text() == str(interrupted)
    assert (actor / f"iter_{interrupted:07d}" / "rlmega.json").is_file()
    rows = run.new_rows()
    assert [row["step"] for row in rows] == list(range(1, interrupted + 1))
    assert rows[-1]["sync/max_logprob_diff"] < 1e-3  # the interrupted sync completed and was checked
    run.assert_nothing_left()

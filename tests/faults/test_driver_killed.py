"""The driver killed with SIGKILL at 20 seeded points of a short run, then resumed (``resume=auto``) after each:
every step's metrics equal those of an uninterrupted run, the data order too, a checkpoint killed halfway
through its save is never resumed from, and after each kill no process of the run is left."""

import json
import random
import time

import pytest

from fault_helpers import ONE_RANK, _comparable, _rows, wait_for

pytestmark = pytest.mark.timeout(1800)

TOTAL_STEPS = 48
RUN = [f"trainer.total_steps={TOTAL_STEPS}", *ONE_RANK, "trainer.max_checkpoints_to_keep=2"]
KILL_SEED = 1201
PHASES = ("start", "save", "sync", "moment")
KILLS_PER_PHASE = 5
"""20 kills, 5 in each phase, in an order the seed shuffles:
- ``start``: a seeded moment of the start-up (imports, Ray, the ranks and engine starting, the checkpoint's load,
  the warm-start, the first sync), at the latest when the run's first new metrics row appears;
- ``save``: inside a checkpoint save, while its ``iter_*.tmp`` is being written;
- ``sync``: inside the weight sync after an update (the rank process is named ``RankProcess.push_weights``);
- ``moment``: a seeded moment of a step, within one step's time (the reference run's mean interval between
  metrics rows) after the previous step's row: generation, log-probs, update, or that step's save.
Moments are fractions of what the reference run measured, not fixed seconds, so that the chain moves on as
planned however fast a step is."""

MOVES = {"start": 1, "save": 3, "sync": 2, "moment": 3}
"""The most steps a kill of each phase can move the chain's checkpoint on. A kill's target is 2-3 steps past the
checkpoint it resumed from. ``start``: killed at the latest as the first new row appears, whose save may just have
finished. ``save``: the ranks may outlive the driver long enough to finish the target step's save. ``sync``: the
target step's sync comes before its row and save. ``moment``: within a step's time of the previous row, which a
fast step may just beat."""


def _trained_prompts(run_dir):
    return [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


def _tracker(run_dir) -> int:
    path = run_dir / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else 0


def kill_plan(seed: int = KILL_SEED) -> list[str]:
    points = [phase for phase in PHASES for _ in range(KILLS_PER_PHASE)]
    random.Random(seed).shuffle(points)
    return points


def test_kill_plan_covers_every_phase_and_fits_the_run():
    plan = kill_plan()
    assert len(plan) == 20 and {plan.count(phase) for phase in PHASES} == {KILLS_PER_PHASE}
    # However far each kill moves the chain on, the last kill's target (at most 3 past the checkpoint it resumes
    # from) is a step of the run with one more after it, so that the run is still going when the kill comes.
    furthest = sum(MOVES[point] for point in plan[:-1])
    assert furthest + 3 + 1 <= TOTAL_STEPS


def test_driver_killed_at_20_seeded_points_resumes_to_the_uninterrupted_metrics(start_run):
    """One uninterrupted reference run, then ONE run killed at the 20 points of ``kill_plan()`` and resumed after
    each (a chain: every resume after the first starts from a checkpoint that a resumed process wrote, and some
    from one that a start-up kill left untouched). ``KILL_SEED`` also picks each point's step (2 or 3 steps past
    the checkpoint it resumed from) and moment (within the reference run's start-up for ``start``)."""
    reference = start_run("reference", *RUN)
    reference.wait_step(1)
    first_row = time.time()
    startup_s = first_row - reference.started
    reference.wait_step(TOTAL_STEPS)
    step_s = (time.time() - first_row) / (TOTAL_STEPS - 1)
    assert reference.process.wait(timeout=600) == 0, reference.output()[-3000:]
    expected = _rows(reference.run_dir)
    assert [row["step"] for row in expected] == list(range(1, TOTAL_STEPS + 1))

    rng = random.Random(KILL_SEED)
    run_dir, landed, cut_saves = None, [], 0
    for number, point in enumerate(kill_plan()):
        run = start_run("killed", *RUN, log_name=f"killed-{number}")
        run_dir = run.run_dir
        resumed_from = _tracker(run_dir)
        # The step in which this kill lands: a step after a new checkpoint, so that the chain moves on.
        target = resumed_from + rng.randint(2, 3)
        moment = rng.uniform(0.0, startup_s if point == "start" else step_s)
        if point == "start":  # a resumed run starts faster than the reference (no warm-start): a new row ends it
            started = time.monotonic()
            wait_for(lambda: time.monotonic() - started >= moment or run.last_step() > resumed_from, 600.0,
                     "the start-up kill's moment", run.process, poll_s=0.01)
            run.snapshot()
        else:
            ranks = run.processes("ray::RankProcess")
            if resumed_from:
                found = run.wait_for_output("resumed from")
                assert f"iter_{resumed_from:07d} (step {resumed_from})" in found, found  # never a half-written one
        staged = []

        def staging():  # a new step's checkpoint being written (its metrics row came just before it)
            actor = run_dir / "checkpoints" / "actor"
            staged[:] = [path for path in actor.glob("iter_*.tmp") if int(path.name[5:12]) >= target]
            return staged

        if point != "start":
            run.wait_step(target - 1)
            run.snapshot()  # now, so that nothing but a title check stands between the moment and the kill
        if point == "save":
            run.wait_title(ranks, "ray::RankProcess.save", also=staging)
        elif point == "sync":
            run.wait_title(ranks, "ray::RankProcess.push_weights")  # the initial sync came before any new row
        elif point == "moment":
            time.sleep(moment)
        assert run.process.poll() is None, f"the run ended before kill point {number} ({point})"
        run.kill_driver(snapshot=False)
        landed.append((point, target, run.last_step()))
        run.assert_nothing_left()
        saved = _tracker(run_dir)
        # The tracker always names a complete checkpoint; a cut save leaves only its staging directory.
        assert saved == 0 or (run_dir / "checkpoints" / "actor" / f"iter_{saved:07d}" / "rlmega.json").is_file()
        assert saved >= resumed_from, (saved, resumed_from, landed)  # a kill never loses a finished checkpoint
        if staged:
            half_written = int(staged[0].name[5:12])
            if staged[0].is_dir():  # the save died with the ranks: only its staging directory is left
                assert saved == half_written - 1, (staged, saved, landed)
                cut_saves += 1
            else:  # the ranks outlived the driver (the guardian polls) long enough to finish the save, whole
                assert saved == half_written, (staged, saved, landed)

    assert cut_saves > 0, landed  # at least one of the five save kills left a half-written checkpoint behind
    last_saved = _tracker(run_dir)
    assert last_saved < TOTAL_STEPS, landed  # the chain ended inside the run, so the last resume has steps to do
    final = start_run("killed", *RUN, log_name="killed-final")
    final.wait_step(last_saved + 1)
    final.snapshot()  # the finished run leaves nothing behind either (its guardian included)
    assert final.process.wait(timeout=600) == 0, final.output()[-3000:]
    if last_saved:
        assert f"iter_{last_saved:07d} (step {last_saved})" in final.output()
    assert _tracker(run_dir) == TOTAL_STEPS
    got = _rows(run_dir)
    assert [row["step"] for row in got] == list(range(1, TOTAL_STEPS + 1)), landed
    for want, have in zip(expected, got):
        assert _comparable(have) == pytest.approx(_comparable(want), rel=1e-6, abs=1e-6), (have["step"], landed)
    assert _trained_prompts(run_dir) == _trained_prompts(reference.run_dir)
    assert not list((run_dir / "checkpoints" / "actor").glob("iter_*.tmp"))  # the killed save's staging is gone
    final.assert_nothing_left()
    print("kill points (phase, target step, last metrics row):", landed)

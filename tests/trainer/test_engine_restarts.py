"""``rollout.restart_dead_engines`` without Ray: the budget over its window of steps; the settings it cannot work
with, refused at load; and the asynchronous schedule with a fake engine that dies in a request: its responses are
submitted again, the replacement gets no request before the trainer gave it the weights and checked them, and a
death beyond the budget stops the run naming the engine. (Real engines killed with SIGKILL:
tests/faults/test_engine_restarted.py.)"""

import dataclasses
import json
from concurrent.futures import Future

import pytest
from ray.exceptions import ActorDiedError

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.controller import Trainer
from rlmega.trainer.engine_restarts import EngineRestarts
from rlmega.trainer.in_process import runs_in_process
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.remote import WorkerFailure, failure_of

from .fakes import FakeActor, FakeAsyncEngines, FakeJob, FakeReference
from .test_async_loop import N, PROMPTS, _config

pytestmark = pytest.mark.timeout(120)

STEPS = 6


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


def _death(name: str = "rollout engine 0") -> WorkerFailure:
    return failure_of(ActorDiedError(), name, "generate")


def test_each_engine_may_restart_k_times_within_the_window():
    restarts = EngineRestarts(dataclasses.replace(load_config("tiny_cpu", check=False).rollout,
                                                  restart_dead_engines=2, restart_window_steps=10))
    restarts.step = 3
    assert restarts.allow(0, _death()) == 1
    restarts.step = 8
    assert restarts.allow(0, _death()) == 2
    assert restarts.allow(1, _death("rollout engine 1")) == 1  # each engine has a budget of its own
    restarts.step = 12
    spent = (r"^generate: rollout engine 0 died \(.*; it had been restarted 2 time\(s\) within the last 10 steps, "
             r"as many as rollout.restart_dead_engines=2 allows")
    with pytest.raises(WorkerFailure, match=spent):
        restarts.allow(0, _death())
    restarts.step = 13  # the restart at step 3 has left the window
    assert restarts.allow(0, _death()) == 2
    restarts.resubmitted(5)
    assert restarts.metrics() == {"rollout/engine_restarts": 4.0, "rollout/resubmitted_requests": 5.0}
    assert restarts.metrics() == {"rollout/engine_restarts": 0.0, "rollout/resubmitted_requests": 0.0}  # per step


@pytest.mark.parametrize("overrides, message", [
    (["rollout.restart_dead_engines=-1"], "rollout.restart_dead_engines: must be an int >= 0, got -1"),
    (["rollout.restart_dead_engines=1", "rollout.restart_window_steps=0"],
     "rollout.restart_window_steps: must be an int >= 1, got 0"),
    (["rollout.restart_dead_engines=1", "rollout.mode=one_step_off", "rollout.placement=disaggregated"],
     "rollout.restart_dead_engines: one_step_off generates the next step while the ranks train, so they cannot give "
     "a restarted engine the weights that step is generated from; use rollout.mode=sync or async, or set it to 0"),
    (["rollout.restart_dead_engines=2", "cluster.in_process=always", "rollout.placement=colocated", "layout.tp=1",
      "layout.world_size=1"],
     "cluster.in_process: always, but this run cannot run in one process: rollout.restart_dead_engines=2 (an engine "
     "is restarted in a process of its own; one in the driver's process that dies takes the driver with it). "
     "Set cluster.in_process=auto to run it on Ray"),
])
def test_settings_a_restart_cannot_work_with_are_refused(tmp_path, assets, overrides, message):
    with pytest.raises(UserError) as error:
        _config(tmp_path, assets, "rollout.mode=sync", *overrides)
    assert str(error.value) == message


def test_a_run_in_one_process_goes_on_ray_to_restart_its_engine(tmp_path, assets):
    one_process = ["rollout.mode=sync", "rollout.placement=colocated", "layout.tp=1", "layout.world_size=1",
                   "cluster.in_process=auto"]
    assert runs_in_process(_config(tmp_path, assets, *one_process))
    assert not runs_in_process(_config(tmp_path, assets, *one_process, "rollout.restart_dead_engines=1"))


class _Handle:
    """One engine as the trainer's weight sync sees it (``FakeActor.push_weights`` sets its version)."""

    asleep = False

    def __init__(self):
        self.served = 0

    def weight_version(self) -> int:
        return self.served


class DyingEngines(FakeAsyncEngines):
    """``FakeAsyncEngines`` whose one engine dies in the requests numbered ``die_in`` (the request fails as a killed
    actor's does) and is replaced as ``RolloutGroup`` does it: the replacement gets no request until ``rejoin``."""

    def __init__(self, tokenizer, stop_token_id: int, restarts: EngineRestarts, die_in: set[int]):
        super().__init__(tokenizer, stop_token_id, tick_s=0.02)
        self.restarts, self.die_in = restarts, die_in
        self.names, self.engines, self.unserved = ["rollout engine 0"], [_Handle()], set()
        self.requests = 0
        self.lost_responses = 0

    def submit(self, engine, prompts, params):
        assert engine not in self.unserved, "a request reached a restarted engine before it had the current weights"
        self.requests += 1
        if self.requests not in self.die_in:
            return super().submit(engine, prompts, params)
        self.lost_responses += len(prompts)
        died: Future = Future()
        died.set_exception(ActorDiedError())
        return died

    def replace(self, index: int, failure: WorkerFailure) -> bool:
        if failure.dead != self.names[index]:
            return False
        self.restarts.allow(index, failure)
        self.engines[index] = _Handle()
        self.unserved.add(index)
        return True

    def rejoin(self) -> None:
        for index in sorted(self.unserved):
            self.restarts.serve(self.engines[index])
            self.unserved.discard(index)

    def handles(self) -> list:
        # As RolloutGroup's: a new handle for a replacement, which gets its weights from ``rejoin`` first.
        return [] if self.unserved else [self, *self.engines]

    def version(self):
        return None if self.unserved else self.served


def _dying_trainer(tmp_path, assets, die_in, *overrides):
    config = _config(tmp_path, assets, "rollout.restart_dead_engines=1", "sync.post_sync_check=true",
                     "sync.check_every=1000", f"trainer.total_steps={STEPS}", *overrides)
    prompts = build_prompt_side(config)
    engines = DyingEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], EngineRestarts(config.rollout),
                           die_in)
    actor = FakeActor()
    trainer = Trainer(config, prompts, FakeJob(), actor, engines,
                      reference=FakeReference() if config.needs_reference else None)
    return trainer, actor, engines


def test_async_resubmits_a_dead_engines_requests_to_its_checked_replacement(tmp_path, assets):
    trainer, actor, engines = _dying_trainer(tmp_path, assets, {3})
    assert trainer.fit() == 0
    assert engines.lost_responses > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(row["rollout/engine_restarts"] for row in rows) == 1
    assert sum(row["rollout/resubmitted_requests"] for row in rows) == engines.lost_responses
    assert len(actor.checked) == 2  # the first sync's check, and the replacement's whatever sync.check_every says
    assert engines.engines[0].served >= 1  # the replacement serves what the trainer trained
    # The run's weight sync is set up again at the next sync once the engines it feeds changed.
    assert actor.connected[-1] == [engines, engines.engines[0]] and actor.connected[0][1] is not engines.engines[0]
    trained = [json.loads(line)["prompts"] for line in (tmp_path / "trained_prompts.jsonl").read_text().splitlines()]
    flat = [index for prompts in trained for index in prompts]
    assert len(trained) == STEPS and len(flat) == len(set(flat)) == STEPS * PROMPTS
    assert all(row["batch/num_sequences"] == PROMPTS * N for row in rows)


def test_async_stops_when_an_engine_dies_more_often_than_allowed(tmp_path, assets):
    trainer, _, _ = _dying_trainer(tmp_path, assets, {2, 4})
    spent = r"generate: rollout engine 0 died \(.*; it had been restarted 1 time\(s\) within the last 100 steps"
    with pytest.raises(WorkerFailure, match=spent):
        trainer.fit()

"""The asynchronous rollout modes driven with fake parts (no Ray): the staleness bound, held from the
weight version of every token; partial rollouts that carry mixed versions into the loss with each
token's own behaviour log-prob; restart instead of continue; stale groups regenerated or dropped; a
resume that neither loses nor repeats a prompt; one-step-off's delayed-rollout equivalence."""

import dataclasses
import json
import math
import re

import pytest
import torch

from rlmega.config import load_config
from rlmega.rollout.protocol import Generation
from rlmega.trainer.async_rollouts import AsyncRollouts, _Done, _Group, _Response
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.resume import ResumeDecision
from rlmega.trainer.schedules import rollout_schedule

from .fakes import (ROLLOUT_LOGP, FakeActor, FakeAsyncEngines, FakeEngines, FakeJob, FakeReference, MidGenerationActor,
                    RecordedTakes)

N, PROMPTS = 2, 2


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


def _config(tmp_path, assets, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if not (tmp_path / "assets").exists():
        (tmp_path / "assets").symlink_to(assets)
    return load_config("tiny_cpu", [
        f"run_dir={tmp_path}", "trainer.total_steps=6", f"trainer.prompts_per_step={PROMPTS}", f"rollout.n={N}",
        "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
        "reward.num_workers=1", "metrics.backends=[jsonl]", "metrics.plot=false", "actor.ppo_mini_batches=1",
        "trainer.fuse_old_logprob=false", "rollout.placement=disaggregated", "rollout.mode=async",
        "sync.post_sync_check=false", "cluster.timeout_s=60", *overrides])


def _async_trainer(tmp_path, assets, *overrides, tick_s=0.02, actor=None, job=None, engines=FakeAsyncEngines,
                   start=ResumeDecision()):
    config = _config(tmp_path, assets, *overrides)
    prompts = build_prompt_side(config)
    engines = engines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], tick_s=tick_s)
    actor = actor(engines) if actor else FakeActor()
    trainer = Trainer(config, prompts, job or FakeJob(), actor, engines,
                      reference=FakeReference() if config.needs_reference else None, start=start)
    return trainer, actor, engines, RecordedTakes(trainer)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_never_trains_beyond_its_staleness_bound(tmp_path, assets, staleness):
    trainer, actor, _, recording = _async_trainer(tmp_path, assets, f"rollout.max_staleness={staleness}")
    assert trainer.fit() == 0
    assert sorted(recording.taken) == list(range(1, 7)) and len(actor.updates) == 6
    for step, rollouts in recording.taken.items():
        policy = step - 1  # the version step k updates from
        oldest = min(int(v.min()) for v in rollouts.token_versions)
        assert policy - oldest <= staleness, (step, oldest)
        assert len(rollouts.prompt_indices) == PROMPTS and len(rollouts.batch.tokens) == PROMPTS * N


def test_partial_rollouts_mix_versions_and_use_each_tokens_behaviour_logprob(tmp_path, assets):
    threshold = 5.0
    trainer, actor, engines, recording = _async_trainer(
        tmp_path, assets, "rollout.max_staleness=2", "rollout.partial_rollout=continue",
        "algorithm.rollout_correction.rollout_is=token", f"algorithm.rollout_correction.rollout_is_threshold={threshold}",
        tick_s=0.5, actor=MidGenerationActor)
    assert trainer.fit() == 0
    assert engines.aborted > 0
    mixed = 0
    for step, rollouts in recording.taken.items():
        update = actor.updates[step - 1]
        weights = update.fields["rollout_is_weights"]
        for logp, versions, weight in zip(rollouts.rollout_logp, rollouts.token_versions, weights):
            mixed += len(set(versions.tolist())) > 1
            # Each token's behaviour log-prob is that of the weights that produced it ...
            torch.testing.assert_close(logp, ROLLOUT_LOGP - 0.1 * versions.float(), rtol=0, atol=1e-6)
            # ... and its IS weight compares the trainer's old log-prob (ROLLOUT_LOGP) with it.
            expected = torch.clamp(torch.exp(ROLLOUT_LOGP - (ROLLOUT_LOGP - 0.1 * versions.double())), max=threshold)
            torch.testing.assert_close(weight.double(), expected, rtol=1e-6, atol=1e-6)
    assert mixed > 0, "no response was continued with newer weights"


def test_restart_throws_partial_responses_away(tmp_path, assets):
    trainer, actor, engines, recording = _async_trainer(
        tmp_path, assets, "rollout.max_staleness=2", "rollout.partial_rollout=restart", tick_s=0.5,
        actor=MidGenerationActor)
    assert trainer.fit() == 0
    assert engines.aborted > 0
    for rollouts in recording.taken.values():
        for versions in rollouts.token_versions:
            assert len(set(versions.tolist())) == 1


class RightOnEvenSums(FakeAsyncEngines):
    """Every response to a prompt whose sum is even is right, so its group's scores are all equal whatever the
    timing. Otherwise a group of three has one off-by-one answer (its seeds cover the three residues), unless a
    weight sync cuts that response after a first digit it shares with the right answer (12 vs 13): the
    continuation then turns it right, so which other groups end up equal depends on the timing."""

    def target(self, prompt, request):
        a, b = re.findall(r"(\d+)\+(\d+)=", self.tokenizer.decode(prompt))[-1]
        if (int(a) + int(b)) % 2 == 0:
            request = dataclasses.replace(request, seed=1)  # not one of the off-by-one third
        return super().target(prompt, request)


def test_dynamic_sampling_drops_equal_groups_in_async_mode(tmp_path, assets):
    trainer, actor, _, recording = _async_trainer(tmp_path, assets, "algo=dapo", "rollout.n=3",
                                                  "actor.policy_loss.kl_loss_coef=0", "algorithm.max_generation_rounds=20",
                                                  engines=RightOnEvenSums)
    assert trainer.fit() == 0
    for rollouts in recording.taken.values():
        for group in set(rollouts.group_ids):
            scores = rollouts.scores[[i for i, g in enumerate(rollouts.group_ids) if g == group]]
            assert len(scores) == 3 and scores.max() > scores.min()  # only mixed groups are trained on
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(row["batch/dropped_groups"] for row in rows) > 0


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_stale_groups_are_regenerated_or_dropped(tmp_path, assets, policy):
    config = _config(tmp_path, assets, "rollout.max_staleness=1", f"rollout.stale_groups={policy}")
    prompts = build_prompt_side(config)
    engines = FakeAsyncEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])
    schedule = rollout_schedule(prompts, engines)
    record = prompts.data.dataset.batch([0])[0]
    fresh = _Group(0, record, [_Response([1], [-0.5], [3], "stop")] * N)
    stale = _Group(1, record, [_Response([1, 2], [-0.5, -0.5], [1, 3], "stop")] * N)  # oldest token: version 1
    schedule._version = 3
    schedule._live = 2
    schedule._buffer = [_Done(fresh, [], torch.zeros(N)), _Done(stale, [], torch.zeros(N))]
    usable = schedule._sort_out_stale()
    assert [done.group.draw for done in usable] == [0] and len(schedule._buffer) == 1
    if policy == "regenerate":
        assert schedule._window.stale_regenerated == 1 and len(schedule._pending) == N
        assert {group.draw for group, _ in schedule._pending} == {1} and schedule._live == 2
    else:
        assert schedule._window.stale_dropped == 1 and not schedule._pending
        assert 1 in schedule._consumed and schedule._live == 1
    prompts.close()


class _ResumableJob(FakeJob):
    def __init__(self, saved_extra=None):
        super().__init__()
        self.saved_extra = saved_extra

    def load(self, root, step):
        return self.saved_extra


def test_resume_neither_loses_nor_repeats_a_prompt(tmp_path, assets):
    first_job = FakeJob()
    trainer, _, _, first = _async_trainer(tmp_path / "a", assets, "trainer.save_every=2", "rollout.max_staleness=1",
                                          job=first_job)
    assert trainer.fit() == 0
    extra = next(extra for _, extra, _ in first_job.saved if extra["step"] == 2)
    # The second run resumes from the step-2 checkpoint (as after a kill -9 during step 3).
    trainer, _, _, second = _async_trainer(tmp_path / "b", assets, "trainer.save_every=2", "rollout.max_staleness=1",
                                           job=_ResumableJob(extra), start=ResumeDecision(step=2))
    assert trainer.start_step == 2
    assert trainer.fit() == 0
    before = [i for step in (1, 2) for i in first.taken[step].prompt_indices]
    after = [i for step in (3, 4, 5, 6) for i in second.taken[step].prompt_indices]
    trained = before + after
    assert len(set(trained)) == len(trained), "a prompt was trained on twice"
    order = trainer.prompts.data.sampler.epoch_order(0)
    # Every prompt of the epoch's order up to the last one trained was trained, bar the few still in flight.
    last = max(order.index(i) for i in trained)
    missing = [i for i in order[:last] if i not in trained]
    assert len(missing) <= 2 * PROMPTS, missing


def test_one_step_off_equals_a_synchronous_run_with_rollouts_delayed_by_one_step(tmp_path, assets, monkeypatch):
    def run(directory, overlap):
        config = _config(directory, assets, "rollout.mode=one_step_off", "rollout.temperature=0.7")
        prompts = build_prompt_side(config)
        engines, actor = FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0]), FakeActor()
        trainer = Trainer(config, prompts, FakeJob(), actor, engines, reference=FakeReference())
        trainer.schedule.overlap = overlap
        recording = RecordedTakes(trainer)
        assert trainer.fit() == 0
        return recording.taken, actor

    overlapped, actor_a = run(tmp_path / "a", True)
    delayed, actor_b = run(tmp_path / "b", False)
    for step in range(1, 7):
        a, b = overlapped[step], delayed[step]
        assert set(a.weight_versions) == {max(0, step - 2)}  # generated from the weights step k-1 trained from
        assert [t.tolist() for t in a.batch.tokens] == [t.tolist() for t in b.batch.tokens]
        assert torch.equal(a.scores, b.scores) and a.prompt_indices == b.prompt_indices
        for x, y in zip(actor_a.updates[step - 1].fields["advantages"], actor_b.updates[step - 1].fields["advantages"]):
            assert torch.equal(x, y)
    assert math.isfinite(float(a.scores.mean()))


def test_each_engine_request_holds_one_steps_prompts_oldest_first(tmp_path, assets, monkeypatch):
    """With work of several steps waiting (a staleness bound of 2, syncs that interrupt), every request
    carries the responses of one step's prompts only, the oldest waiting: the batch the trainer waits for
    never waits for a later batch's slowest response."""
    requests, mixed_waiting = [], []
    dispatch = AsyncRollouts._dispatch

    def recorded(self):
        waiting = {group.draw // self.per_step for group, _ in self._pending}
        before = set(self._in_flight)
        dispatch(self)
        for future in set(self._in_flight) - before:
            steps = {group.draw // self.per_step for group, _ in self._in_flight[future][1]}
            requests.append(steps)
            mixed_waiting.append(len(waiting) > 1)
            assert min(steps) == min(waiting), (steps, waiting)

    monkeypatch.setattr(AsyncRollouts, "_dispatch", recorded)
    trainer, actor, engines, _ = _async_trainer(tmp_path, assets, "rollout.max_staleness=2", actor=MidGenerationActor)
    assert trainer.fit() == 0 and len(actor.updates) == 6
    assert engines.aborted  # syncs interrupted requests, so continuations waited beside new prompts
    assert any(mixed_waiting), "no dispatch found work of two steps waiting; the test checks nothing"
    assert all(len(steps) == 1 for steps in requests), requests


class RefusingEngines(FakeAsyncEngines):
    """Engines that answer every request with empty aborts, as an engine that keeps refusing a request would."""

    def _run(self, prompts, params, version):
        self.aborted += len(prompts)
        return [Generation(prompt_index=row, response_token_ids=[], logprobs=[], finish_reason="abort",
                           weight_version=version) for row in range(len(prompts))]


def test_resubmissions_of_a_response_that_never_progresses_are_bounded(tmp_path, assets):
    from rlmega.trainer.async_rollouts import MAX_EMPTY_ABORTS

    trainer, _, engines, _ = _async_trainer(tmp_path, assets, engines=RefusingEngines)
    with pytest.raises(RuntimeError, match=f"aborted a response {MAX_EMPTY_ABORTS + 1} times in a row"):
        trainer.fit()
    assert engines.aborted <= (MAX_EMPTY_ABORTS + 1) * PROMPTS * N * 4

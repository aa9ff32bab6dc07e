"""``rollout.mode=async`` through the gateway: the harness's sessions run while the trainer trains, each call served
by the weights the engines hold then. A call that spans a weight update is continued with the new weights (its
reply then holds two versions) or restarted (one); a stale group's sessions run again; a hanging harness loses its
session, not the step; the calls of many sessions reach the engines together; and the real stack trains this way
(the post-sync check holds, no session lost) and resumes a killed run without losing or repeating a prompt."""

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest

from agent.helpers import ScriptedGenerator, bpe_tokenizer
from rlmega.config import load_config
from rlmega.gateway import Gateway
from rlmega.trainer.async_rollouts import _Done, _Group, _Response
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.schedules import rollout_schedule
from trainer.fakes import FakeActor, FakeAsyncEngines, FakeJob, FakeReference, MidGenerationActor, RecordedTakes

N, PROMPTS = 2, 2
HARNESS = ["gateway.enabled=true", "gateway.harness=rlmega.gateway.examples:single_turn"]
REPLY = "1234"


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


def _config(tmp_path, assets, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if not (tmp_path / "assets").exists():
        (tmp_path / "assets").symlink_to(assets)
    return load_config("tiny_cpu", [
        f"run_dir={tmp_path}", "trainer.total_steps=3", f"trainer.prompts_per_step={PROMPTS}", f"rollout.n={N}",
        "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
        "reward.num_workers=1", "metrics.backends=[jsonl]", "metrics.plot=false", "actor.ppo_mini_batches=1",
        "trainer.fuse_old_logprob=false", "rollout.placement=disaggregated", "rollout.mode=async",
        "sync.post_sync_check=false", "cluster.timeout_s=120", "gateway.session_timeout_s=120", *HARNESS,
        *overrides])


class ReplyingEngines(FakeAsyncEngines):
    """Answers every call with ``REPLY`` and the stop token, one token a tick (a pause cuts a call after its first
    token); a continued call carries on after what its prompt already ends with."""

    def target(self, prompt, request):
        reply = self.tokenizer.encode(REPLY, add_special_tokens=False) + [self.stop_token_id]
        done = next((k for k in range(len(reply) - 1, 0, -1) if prompt[-k:] == reply[:k]), 0)
        return reply[done:]


def _policy_versions(rollouts):
    """Per trained response, the weight versions of the policy's own tokens."""
    return [set(versions[mask.bool()].tolist()) for versions, mask in zip(rollouts.token_versions,
                                                                          rollouts.response_mask)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("partial", ["continue", "restart"])
def test_a_call_across_a_weight_update_is_continued_or_restarted(tmp_path, assets, partial):
    config = _config(tmp_path, assets, "rollout.max_staleness=2", f"rollout.partial_rollout={partial}")
    prompts = build_prompt_side(config)
    engines = ReplyingEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], tick_s=0.3)
    actor = MidGenerationActor(engines)
    trainer = Trainer(config, prompts, FakeJob(), actor, engines,
                      reference=FakeReference() if config.needs_reference else None)
    recording = RecordedTakes(trainer)
    assert trainer.fit() == 0
    assert engines.aborted > 0, "no call was in flight across a weight update"
    versions = [found for rollouts in recording.taken.values() for found in _policy_versions(rollouts)]
    replies = [prompts.data.tokenizer.decode(tokens[length:]) for rollouts in recording.taken.values()
               for tokens, length in zip(rollouts.batch.tokens, rollouts.batch.prompt_lengths)]
    assert all(reply.startswith(REPLY) for reply in replies), replies  # a continued call's reply is whole
    if partial == "continue":
        assert any(len(found) == 2 for found in versions), versions
    else:
        assert all(len(found) == 1 for found in versions), versions
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "async/staleness_max" in row]
    assert len(rows) == 3 and all(row["gateway/lost_sessions"] == 0 for row in rows)
    if partial == "restart":
        assert sum(row["async/restarted_responses"] for row in rows) > 0


@pytest.mark.timeout(120)
def test_a_harness_past_its_timeout_loses_its_session_not_the_step(tmp_path, assets):
    from gateway import hanging_harness

    config = _config(tmp_path, assets, "trainer.total_steps=1", "gateway.harness=gateway.hanging_harness:run",
                     "gateway.session_timeout_s=3")
    prompts = build_prompt_side(config)
    engines = ReplyingEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], tick_s=0.01)
    trainer = Trainer(config, prompts, FakeJob(), FakeActor(), engines,
                      reference=FakeReference() if config.needs_reference else None)
    try:
        assert trainer.fit() == 0
    finally:
        hanging_harness.RELEASE.set()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "async/staleness_max" in line]
    # The first session of each prompt scored so far (the batch's and those admitted after it); the others train.
    assert row["gateway/lost_sessions"] >= PROMPTS and row["gateway/lost_session_fraction"] == 1 / N


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_a_stale_group_runs_its_sessions_again_or_is_dropped(tmp_path, assets, policy):
    config = _config(tmp_path, assets, "rollout.max_staleness=1", f"rollout.stale_groups={policy}")
    prompts = build_prompt_side(config)
    engines = ReplyingEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])
    schedule = rollout_schedule(prompts, engines)
    try:
        record = prompts.data.dataset.batch([0])[0]
        fresh = _Group(0, record, [_Response([1], [-0.5], [3], "stop")] * N)
        stale = _Group(1, record, [_Response([1, 2], [-0.5, -0.5], [1, 3], "stop")] * N)  # oldest: version 1
        with schedule._lock:
            schedule._version, schedule._live = 3, 2
            schedule._buffer = [_Done(fresh, [], None), _Done(stale, [], None)]
            usable = schedule._sort_out_stale()
        assert [done.group.draw for done in usable] == [0]
        if policy == "drop":
            assert schedule._window.stale_dropped == 1 and 1 in schedule._consumed and not schedule._pending
            return
        assert schedule._window.stale_regenerated == 1 and schedule._live == 2
        # The group's sessions start again: the harness calls, and each call waits for an engine (paused here).
        with schedule._lock:
            assert schedule._lock.wait_for(lambda: len(schedule._pending) == N, timeout=60), schedule._pending
            calls = list(schedule._pending)
        assert {group.draw for group, _ in calls} == {1} and sorted(sample for _, sample in calls) == list(range(N))
        for group, sample in calls:
            session = group.responses[sample].agent
            assert session.record is record and session.call is not None and not session.done
    finally:
        schedule.close()
        prompts.close()


@pytest.mark.timeout(60)
def test_the_gateway_serves_as_many_calls_at_once_as_it_allows():
    tokenizer = bpe_tokenizer()
    eos = tokenizer.eos_token_id
    sessions = min(32, (os.cpu_count() or 1) + 4) + 2  # more than asyncio's default pool has threads
    together = threading.Barrier(sessions, timeout=20)

    def reply(context, call):
        together.wait()  # every call must be in the engine at once
        return [eos]

    engine = ScriptedGenerator(reply, stop_token_ids=[eos])
    gateway = Gateway(engine.generate, tokenizer, stop_token_ids=(eos,), timeout_s=30,
                      max_concurrent_calls=sessions).serve()
    try:
        def call(index, answers):
            answers[index] = httpx.post(f"{gateway.session_url(f's{index}')}/completions",
                                        json={"prompt": "1+1=", "max_tokens": 2}, timeout=40).status_code

        answers = [None] * sessions
        threads = [threading.Thread(target=call, args=(index, answers)) for index in range(sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=50)
        assert answers == [200] * sessions
    finally:
        gateway.close()
    assert gateway._executor is None  # shut down with the gateway


def test_the_config_check_accepts_async_through_the_gateway(tmp_path, assets):
    config = _config(tmp_path, assets)
    assert config.rollout.mode == "async" and config.gateway.enabled


def _run_command(run_dir, assets, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "assets").exists():
        (run_dir / "assets").symlink_to(assets)
    return [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *HARNESS,
            "trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
            "export_hf=false", "reward.num_workers=1", "layout.tp=1", "layout.world_size=1",
            "rollout.placement=disaggregated", "cluster.timeout_s=120", "rollout.mode=async",
            "rollout.max_staleness=1", *overrides]


@pytest.mark.timeout(400)
def test_an_async_run_trains_through_the_gateway(tmp_path, assets):
    run_dir = tmp_path / "run"
    command = _run_command(run_dir, assets, "trainer.total_steps=3", "trainer.save_every=0")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["sync/max_logprob_diff"] < 1e-3
        assert row["gateway/lost_sessions"] == 0
        assert "async/staleness_max" in row and row["async/staleness_max"] <= 1


@pytest.mark.timeout(600)
def test_a_killed_async_run_through_the_gateway_resumes_without_losing_or_repeating_a_prompt(tmp_path, assets):
    from trainer.test_trainer_runs import kill_after_checkpoint

    steps, run_dir = 4, tmp_path / "killed"
    command = _run_command(run_dir, assets, f"trainer.total_steps={steps}", "trainer.save_every=1")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tracker = run_dir / "checkpoints" / "actor" / "latest_checkpointed_iteration.txt"
    killed_at = kill_after_checkpoint(process, tracker, 2, total=steps)  # sessions of later steps were in flight
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1)) and killed_at < steps
    trained = [index for row in rows for index in row["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained on twice"
    for row in rows:
        assert row["step"] - 1 - min(row["weight_versions"]) <= 1  # the staleness bound, after the resume too

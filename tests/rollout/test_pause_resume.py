"""pause_generation / resume_generation: a running generate stops at its next decoding step with its
unfinished responses "abort" (a prefix of the uninterrupted seeded output), calls while paused return
empty aborts at once, and after resume the same call repeats exactly. The engine lock makes a weight
update wait for a running generate. The adapters' pause is tested in test_vllm_adapter / test_sglang_adapter."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlmega.rollout import HFEngine, SamplingParams

from .tiny_models import PROMPTS, checkpoint_tensors

WAIT_S = 60.0  # generous: a wait that ends early is a pass, one that times out is a failure
HOLD_STEP = 4  # the decoding step at which the tests act


def _params() -> list[SamplingParams]:
    """Prompt 1 finishes ("length") before HOLD_STEP; the others run long enough to be interrupted."""
    long = SamplingParams(temperature=1.0, max_new_tokens=60, seed=11)
    return [SamplingParams(temperature=1.0, max_new_tokens=60, n=2, seed=11),
            SamplingParams(temperature=0, max_new_tokens=2), long, long]


class StepGate:
    """A forward hook holding the model's ``step``-th forward (decoding step) until released, so a test
    acts while ``generate`` runs, at a known step."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.step = step
        self.forwards = 0
        self.reached = threading.Event()
        self.release = threading.Event()
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.forwards += 1
        if self.forwards == self.step:
            self.reached.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError("the test never released the decoding step")

    def remove(self) -> None:
        self._handle.remove()


@pytest.fixture
def engine(llama_dir):
    return HFEngine(llama_dir, attn_implementation="eager")


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def _same(actual, expected) -> None:
    assert [(g.prompt_index, g.response_token_ids, g.logprobs, g.finish_reason, g.weight_version) for g in actual] \
        == [(g.prompt_index, g.response_token_ids, g.logprobs, g.finish_reason, g.weight_version) for g in expected]


def _close(actual, expected) -> None:
    """Across processes (another thread count): the same tokens, log-probs to float precision."""
    assert [(g.prompt_index, g.response_token_ids, g.finish_reason, g.weight_version) for g in actual] \
        == [(g.prompt_index, g.response_token_ids, g.finish_reason, g.weight_version) for g in expected]
    torch.testing.assert_close([g.logprobs for g in actual], [g.logprobs for g in expected], rtol=0, atol=1e-6)


def _empty_aborts(generations, prompt_indices: list[int], version: int) -> None:
    assert [g.prompt_index for g in generations] == prompt_indices
    assert all(g.finish_reason == "abort" and g.response_token_ids == [] and g.logprobs == []
               and g.weight_version == version for g in generations)


def test_pause_interrupts_a_running_generate_and_resume_repeats_it(engine, pool):
    params = _params()
    expected = engine.generate(PROMPTS, params)
    assert expected[2].finish_reason == "length" and len(expected[2].response_token_ids) == 2
    assert all(len(g.response_token_ids) > HOLD_STEP for i, g in enumerate(expected) if i != 2)

    gate = StepGate(engine.model, HOLD_STEP)
    running = pool.submit(engine.generate, PROMPTS, params)
    assert gate.reached.wait(WAIT_S)
    engine.pause_generation()
    engine.pause_generation()  # idempotent
    assert engine.health()["paused"] and engine.weight_version() == 0  # neither waits for the running call
    gate.release.set()
    interrupted = running.result(WAIT_S)

    assert [g.prompt_index for g in interrupted] == [g.prompt_index for g in expected]
    for got, full in zip(interrupted, expected):
        if full.finish_reason == "length" and len(full.response_token_ids) <= HOLD_STEP:
            assert (got.response_token_ids, got.logprobs, got.finish_reason) == \
                   (full.response_token_ids, full.logprobs, "length")  # finished before the pause: kept
        else:  # the step being decoded when the pause came completes, then the call returns
            assert got.finish_reason == "abort" and got.weight_version == 0
            assert got.response_token_ids == full.response_token_ids[:HOLD_STEP]
            assert got.logprobs == full.logprobs[:HOLD_STEP]

    forwards = gate.forwards
    _empty_aborts(engine.generate(PROMPTS, params), [0, 0, 1, 2, 3], version=0)
    assert gate.forwards == forwards  # a call while paused never runs the model

    engine.resume_generation()
    engine.resume_generation()  # idempotent
    assert not engine.health()["paused"]
    gate.remove()
    _same(engine.generate(PROMPTS, params), expected)


def test_update_weights_waits_for_a_running_generate(engine, pool, llama_other_dir):
    params = _params()
    expected = engine.generate(PROMPTS, params)
    gate = StepGate(engine.model, HOLD_STEP)
    running = pool.submit(engine.generate, PROMPTS, params)
    assert gate.reached.wait(WAIT_S)

    streaming = threading.Event()

    def stream():
        streaming.set()
        yield from checkpoint_tensors(llama_other_dir).items()

    update = pool.submit(engine.update_weights, stream(), 1)
    # Only a missing lock fails this; a slow machine could only make it pass wrongly.
    assert not streaming.wait(0.5), "update_weights ran while generate was decoding"
    assert engine.weight_version() == 0 and engine.health()["ready"]  # answered without the lock
    gate.release.set()
    _same(running.result(WAIT_S), expected)  # all of it from version 0
    update.result(WAIT_S)
    assert engine.weight_version() == 1
    gate.remove()
    assert [g.response_token_ids for g in engine.generate(PROMPTS, params)] != \
           [g.response_token_ids for g in expected]


def test_calls_while_paused_do_not_wait_for_an_update(engine, pool, llama_other_dir):
    params = _params()
    tensors = sorted(checkpoint_tensors(llama_other_dir).items())
    midway, finish = threading.Event(), threading.Event()

    def stream():
        yield from tensors[:3]
        midway.set()
        if not finish.wait(WAIT_S):
            raise TimeoutError("the test never let the update finish")
        yield from tensors[3:]

    engine.pause_generation()
    update = pool.submit(engine.update_weights, stream(), 1)
    assert midway.wait(WAIT_S)  # the update holds the lock, the weights are mixed
    paused_call = pool.submit(engine.generate, PROMPTS, params)  # would wait for the lock until finish is set
    _empty_aborts(paused_call.result(WAIT_S), [0, 0, 1, 2, 3], version=0)
    finish.set()
    update.result(WAIT_S)
    engine.resume_generation()
    generations = engine.generate(PROMPTS, params)
    assert {g.weight_version for g in generations} == {1} and "abort" not in {g.finish_reason for g in generations}


# ---------------------------------------------------------------------------------------------- Ray

@pytest.mark.timeout(180)
def test_pause_reaches_a_generate_running_in_a_threaded_actor(local_ray, llama_dir):
    import ray

    from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor

    # Run in the actor (local functions travel by value; the test module is not importable there).
    def hold_until_paused(engine, step):
        """Hold decoding step ``step`` until the engine is paused (``health()`` takes no lock)."""
        forwards = []

        def hook(*_):
            forwards.append(1)
            deadline = time.monotonic() + WAIT_S
            while len(forwards) == step and not engine.health()["paused"] and time.monotonic() < deadline:
                time.sleep(0.005)

        engine.model.register_forward_hook(hook)
        engine.forwards_seen = forwards

    def forwards_seen(engine):
        return len(engine.forwards_seen)

    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    expected = HFEngine(llama_dir, attn_implementation="eager").generate(PROMPTS, params)
    remote = RemoteEngine(start_engine_actor(llama_dir, attn_implementation="eager"))
    ray.get(remote.actor.__ray_call__.remote(hold_until_paused, HOLD_STEP))

    running = remote.actor.generate.remote(PROMPTS, params)
    deadline = time.monotonic() + WAIT_S
    while ray.get(remote.actor.__ray_call__.remote(forwards_seen)) < HOLD_STEP:
        assert time.monotonic() < deadline, "generate did not start in the actor"
        time.sleep(0.01)
    remote.pause_generation()  # answered while generate runs: the actor is threaded
    interrupted = ray.get(running, timeout=WAIT_S)
    assert [(g.finish_reason, g.response_token_ids) for g in interrupted] == \
           [("abort", g.response_token_ids[:HOLD_STEP]) for g in expected]
    _empty_aborts(remote.generate(PROMPTS, params), [0, 1, 2, 3], version=0)
    remote.resume_generation()
    assert [g.response_token_ids for g in remote.generate(PROMPTS, params)] == \
           [g.response_token_ids for g in expected]


@pytest.mark.timeout(180)
def test_rollout_group_submit_pause_resume(local_ray, llama_dir):
    import ray

    from rlmega.config.schema import RLConfig
    from rlmega.trainer.remote import WorkerFailure
    from rlmega.trainer.rollout_group import RolloutGroup

    config = RLConfig()
    config.model.path = str(llama_dir)
    config.rollout.engine_kwargs = {"attn_implementation": "eager"}
    config.cluster.timeout_s = WAIT_S
    group = RolloutGroup(config, scheduling=lambda index: "DEFAULT")
    assert group.num_engines == 1
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=3 + i) for i in range(2)]
    expected = HFEngine(llama_dir, attn_implementation="eager").generate(PROMPTS[2:], params)  # seeds as given
    _close(ray.get(group.submit(0, PROMPTS[2:], params), timeout=WAIT_S), expected)

    group.pause_generation()
    _empty_aborts(ray.get(group.submit(0, PROMPTS[2:], params), timeout=WAIT_S), [0, 1], version=0)
    group.resume_generation()
    _close(ray.get(group.submit(0, PROMPTS[2:], params), timeout=WAIT_S), expected)

    ray.kill(group.actors[0])
    deadline = time.monotonic() + WAIT_S
    while True:  # calls made before the kill lands still run
        try:
            ray.get(group.actors[0].health.remote(), timeout=WAIT_S)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed engine still answers"
        time.sleep(0.05)
    with pytest.raises(WorkerFailure, match="pause_generation: rollout engine 0 died"):
        group.pause_generation()

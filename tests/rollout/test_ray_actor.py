"""An HFEngine in a Ray actor answers like the in-process engine."""

import pytest
import torch

from rlmega.rollout import HFEngine, RolloutEngine, SamplingParams
from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor

from .tiny_models import PROMPTS, checkpoint_tensors


@pytest.mark.timeout(120)
def test_generate_and_update_through_an_actor(local_ray, llama_dir, llama_other_dir):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5)
    remote = RemoteEngine(start_engine_actor(llama_dir, attn_implementation="eager"))
    assert isinstance(remote, RolloutEngine)
    local = HFEngine(llama_dir, attn_implementation="eager")

    generations = remote.generate(PROMPTS, params)
    expected = local.generate(PROMPTS, params)
    assert [g.response_token_ids for g in generations] == [g.response_token_ids for g in expected]
    torch.testing.assert_close([g.logprobs for g in generations], [g.logprobs for g in expected], rtol=0, atol=1e-6)

    tensors = checkpoint_tensors(llama_other_dir)
    remote.update_weights(tensors.items(), version=1)
    local.update_weights(tensors.items(), version=1)
    assert remote.weight_version() == 1 and remote.health()["ready"]
    updated = remote.generate(PROMPTS, params)
    assert [g.response_token_ids for g in updated] == [g.response_token_ids for g in local.generate(PROMPTS, params)]
    assert [g.response_token_ids for g in updated] != [g.response_token_ids for g in generations]


def test_model_calls_are_pinned_to_one_thread_and_the_rest_are_not():
    from rlmega.trainer.engine_actor import MODEL_THREAD, engine_actor_class
    from rlmega.rollout.vllm_engine import VLLMEngine

    for engine_class in (HFEngine, VLLMEngine):
        actor_class = engine_actor_class(engine_class)
        subclass = actor_class.__ray_metadata__.modified_class
        groups = {name: getattr(getattr(subclass, name), "__ray_concurrency_group__", None)
                  for name in ("generate", "update_weights", "begin_update", "write_weights", "commit_update", "sleep",
                               "wake", "pause_generation", "resume_generation", "weight_version", "health")}
        pinned = {name for name, group in groups.items() if group == MODEL_THREAD}
        assert pinned == {"generate", "update_weights", "begin_update", "write_weights", "commit_update", "sleep",
                          "wake"}, engine_class
        assert getattr(engine_class.generate, "__ray_concurrency_group__", None) is None  # the engine itself unchanged


@pytest.mark.timeout(120)
def test_every_model_call_of_an_actor_runs_on_the_same_thread(local_ray, llama_dir, llama_other_dir):
    import ray

    def record_threads(engine):
        import threading

        engine.threads_seen = set()
        engine.model.register_forward_hook(lambda *_: engine.threads_seen.add(threading.get_ident()))

    def threads_seen(engine):
        return engine.threads_seen

    remote = RemoteEngine(start_engine_actor(llama_dir, attn_implementation="eager"))
    ray.get(remote.actor.__ray_call__.remote(record_threads))
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=5)
    # Several calls in flight at once: a pool of threads would spread them over its threads.
    ray.get([remote.actor.generate.remote(PROMPTS, params) for _ in range(6)], timeout=100)
    remote.update_weights(checkpoint_tensors(llama_other_dir).items(), version=1)
    ray.get([remote.actor.generate.remote(PROMPTS, params) for _ in range(6)], timeout=100)
    assert len(ray.get(remote.actor.__ray_call__.remote(threads_seen))) == 1

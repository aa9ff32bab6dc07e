"""An HFEngine in a Ray actor answers like the in-process engine."""

import pytest
import torch

from rlmega.rollout import HFEngine, RolloutEngine, SamplingParams
from rlmega.rollout.ray_actor import RemoteEngine, start_engine_actor

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

"""sleep/wake: level 1 keeps the weights, level 2 drops them until every one is re-synced."""

import pytest
import torch

from rlmega.rollout import EngineNotReadyError, HFEngine, SamplingParams

from .tiny_models import PROMPTS, checkpoint_tensors, in_buckets

PARAMS = [SamplingParams(temperature=0, max_new_tokens=6), SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)]


def _outputs(engine):
    return engine.generate(PROMPTS[:2], PARAMS)


def _assert_same_outputs(actual, expected):
    """Tokens equal; log-probs to 1e-6, since re-allocated weights (bit-identical, differently aligned) may
    take CPU kernels down a path that rounds differently in the last bit."""
    assert [g.response_token_ids for g in actual] == [g.response_token_ids for g in expected]
    torch.testing.assert_close([g.logprobs for g in actual], [g.logprobs for g in expected], atol=1e-6, rtol=0)


def test_level_1_keeps_the_weights(llama_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    before = _outputs(engine)
    engine.sleep(level=1)
    assert engine.health()["sleep_level"] == 1 and not engine.health()["ready"]
    with pytest.raises(EngineNotReadyError, match=r"asleep \(level 1\): call wake\(\) first"):
        engine.generate(PROMPTS, PARAMS[0])
    engine.wake()
    assert engine.health()["ready"]
    assert _outputs(engine) == before  # exactly: the same tensors, untouched


@pytest.mark.parametrize("wake_first", [True, False], ids=["wake-then-resync", "resync-then-wake"])
def test_level_2_drops_the_weights_until_all_are_resynced(llama_dir, wake_first):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    before = _outputs(engine)
    resident = engine.health()["resident_weight_bytes"]
    assert resident > 0
    engine.sleep(level=2)
    health = engine.health()
    assert health["resident_weight_bytes"] == 0 and health["missing_weights"] == len(checkpoint_tensors(llama_dir))
    with pytest.raises(EngineNotReadyError, match="call wake\\(\\) and re-sync every weight with update_weights"):
        engine.generate(PROMPTS, PARAMS[0])

    first, *rest = in_buckets(checkpoint_tensors(llama_dir), 3)
    if wake_first:
        engine.wake()
    engine.update_weights(first, version=0)  # re-sending the current version is allowed
    if wake_first:
        remaining = engine.health()["missing_weights"]
        assert remaining == sum(map(len, rest))
        with pytest.raises(EngineNotReadyError, match=f"{remaining} weights dropped by sleep\\(level=2\\) have not"):
            engine.generate(PROMPTS, PARAMS[0])
    for bucket in rest:
        engine.update_weights(bucket, version=0)
    if not wake_first:
        with pytest.raises(EngineNotReadyError, match="asleep"):
            engine.generate(PROMPTS, PARAMS[0])
        engine.wake()
    assert engine.health()["ready"] and engine.health()["resident_weight_bytes"] == resident
    _assert_same_outputs(_outputs(engine), before)


def test_level_2_tracks_each_expert_of_a_fused_tensor(qwen3_moe_dirs):
    own_dir, _ = qwen3_moe_dirs
    engine = HFEngine(own_dir, attn_implementation="eager")
    before = _outputs(engine)
    engine.sleep(level=2)
    engine.wake()
    tensors = checkpoint_tensors(own_dir)
    held_back = "model.layers.1.mlp.experts.2.up_proj.weight"
    engine.update_weights(((k, v) for k, v in tensors.items() if k != held_back), version=0)
    with pytest.raises(EngineNotReadyError, match=r"1 weights .* \(e\.g\. model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        engine.generate(PROMPTS, PARAMS[0])
    engine.update_weights([(held_back, tensors[held_back])], version=0)
    _assert_same_outputs(_outputs(engine), before)


def test_bad_sleep_level_is_rejected(llama_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        engine.sleep(level=3)
    assert engine.health()["ready"]

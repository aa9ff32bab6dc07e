"""HFEngine.update_weights: streamed on-disk tensors make the engine the other checkpoint's model."""

import pytest
import torch

from rlmega.rollout import EngineNotReadyError, HFEngine, SamplingParams, UnknownWeightError

from .tiny_models import (
    PROMPTS,
    checkpoint_tensors,
    greedy_reference,
    in_buckets,
    load_reference,
    stream,
    teacher_forced_logprobs,
)

LOGPROB_ATOL = 1e-4
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=2)


def _assert_engine_is(engine, reference):
    """Greedy tokens equal transformers' greedy decoding; log-probs of greedy and sampled responses equal a
    teacher-forced pass of ``reference``."""
    greedy = engine.generate(PROMPTS, GREEDY)
    assert [g.response_token_ids for g in greedy] == [greedy_reference(reference, p, MAX_NEW) for p in PROMPTS]
    for generation in greedy + engine.generate(PROMPTS, SAMPLED):
        expected = teacher_forced_logprobs(reference, PROMPTS[generation.prompt_index], generation.response_token_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def _assert_same_weights(engine, reference):
    """Every in-memory tensor (fused experts included) equals transformers' own loading, bit for bit."""
    expected = reference.state_dict()
    actual = engine.model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def _streamed_with_versions(engine, buckets, seen_versions):
    """Yield the buckets' tensors, recording the engine's version as each bucket starts."""
    for bucket in buckets:
        seen_versions.append(engine.weight_version())
        yield from bucket


def test_streamed_update_makes_the_engine_the_other_checkpoint(llama_dir, llama_other_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    before = [g.response_token_ids for g in engine.generate(PROMPTS, GREEDY)]
    seen_versions = []
    engine.update_weights(_streamed_with_versions(engine, in_buckets(checkpoint_tensors(llama_other_dir), 3),
                                                  seen_versions), version=1)
    assert seen_versions == [0, 0, 0]  # not committed while streaming
    assert engine.weight_version() == 1
    other = load_reference(llama_other_dir)
    _assert_same_weights(engine, other)
    _assert_engine_is(engine, other)
    after = engine.generate(PROMPTS, GREEDY)
    assert [g.response_token_ids for g in after] != before
    assert {g.weight_version for g in after} == {1}


def test_a_partial_update_writes_only_its_tensors(llama_dir, llama_other_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    first_bucket = dict(in_buckets(checkpoint_tensors(llama_other_dir), 3)[0])
    engine.update_weights(first_bucket.items(), version=4)
    assert engine.weight_version() == 4
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, first_bucket.get(name, original[name])), name


def test_unknown_and_misshapen_names_are_named_and_commit_nothing(llama_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    with pytest.raises(UnknownWeightError, match=r"'model\.layers\.0\.mlp\.gate_prj\.weight'.*did you mean "
                                                 r"'model\.layers\.0\.mlp\.gate_proj\.weight'"):
        engine.update_weights([("model.layers.0.mlp.gate_prj.weight", torch.zeros(96, 64))], version=1)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    with pytest.raises(ValueError, match="version must be an int >= the current weight version 0"):
        engine.update_weights([], version=-1)
    # Nothing was written, so the engine still serves version 0.
    assert engine.weight_version() == 0 and engine.health()["ready"]
    _assert_engine_is(engine, load_reference(llama_dir))
    # An empty update is complete: it commits the version.
    engine.update_weights([], version=1)
    assert engine.weight_version() == 1


def test_an_update_that_fails_part_way_blocks_generation_until_one_completes(llama_dir, llama_other_dir):
    engine = HFEngine(llama_dir, attn_implementation="eager")
    good = sorted(checkpoint_tensors(llama_other_dir).items())
    with pytest.raises(UnknownWeightError, match="'model.layers.7.self_attn.q_proj.weight'"):
        engine.update_weights(good[:5] + [("model.layers.7.self_attn.q_proj.weight", torch.zeros(64, 64))], version=1)
    assert engine.weight_version() == 0
    assert engine.health()["torn_update_version"] == 1 and not engine.health()["ready"]
    with pytest.raises(EngineNotReadyError, match="update to weight version 1 failed part way"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights(good, version=1)
    assert engine.weight_version() == 1 and engine.health()["ready"]
    _assert_engine_is(engine, load_reference(llama_other_dir))


@pytest.mark.parametrize("family", ["qwen3_moe_dirs", "mixtral_dirs"])
def test_per_expert_names_land_in_the_fused_experts(family, request):
    own_dir, other_dir = request.getfixturevalue(family)
    engine = HFEngine(own_dir, attn_implementation="eager")
    tensors = checkpoint_tensors(other_dir)
    assert any(".experts.3." in name for name in tensors)  # per-expert on disk ...
    assert any(name.endswith("experts.gate_up_proj") for name in engine.model.state_dict())  # ... fused in memory
    engine.update_weights(stream(in_buckets(tensors, 2)), version=1)
    other = load_reference(other_dir)
    _assert_same_weights(engine, other)
    _assert_engine_is(engine, other)


def test_fused_layout_is_gate_rows_then_up_rows_untransposed(qwen3_moe_dirs):
    """gate_up_proj[e] = cat(gate_e, up_e) along rows: [E, 2I, H]; down_proj[e] = down_e: [E, H, I]."""
    own_dir, other_dir = qwen3_moe_dirs
    engine = HFEngine(own_dir, attn_implementation="eager")
    tensors = checkpoint_tensors(other_dir)
    engine.update_weights(tensors.items(), version=1)
    experts = engine.model.model.layers[1].mlp.experts
    inter = tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].shape[0]
    for e in range(4):
        prefix = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(experts.gate_up_proj[e, :inter], tensors[f"{prefix}.gate_proj.weight"])
        assert torch.equal(experts.gate_up_proj[e, inter:], tensors[f"{prefix}.up_proj.weight"])
        assert torch.equal(experts.down_proj[e], tensors[f"{prefix}.down_proj.weight"])


def test_fused_in_memory_names_are_accepted_whole(qwen3_moe_dirs):
    own_dir, other_dir = qwen3_moe_dirs
    engine = HFEngine(own_dir, attn_implementation="eager")
    other = load_reference(other_dir)
    engine.update_weights(other.state_dict().items(), version=1)
    _assert_same_weights(engine, other)

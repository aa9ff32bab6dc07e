"""HFEngine.generate against transformers' own decoding and a teacher-forced forward pass."""

import pytest
import torch

from rlmega.rollout import HFEngine, RolloutEngine, SamplingParams

from .tiny_models import PROMPTS, greedy_reference, load_reference, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4  # fp32: KV-cached, left-padded decoding vs one unpadded forward
MAX_NEW = 12


@pytest.fixture(scope="module")
def engine(llama_dir):
    return HFEngine(llama_dir, attn_implementation="eager")


@pytest.fixture(scope="module")
def reference(llama_dir):
    return load_reference(llama_dir)


def _tokens(generations):
    return [g.response_token_ids for g in generations]


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("checkpoint", ["llama_dir", "gpt2_dir"])
def test_greedy_equals_transformers_generate_on_a_left_padded_batch(checkpoint, request):
    engine = HFEngine(request.getfixturevalue(checkpoint), attn_implementation="eager")
    reference = load_reference(request.getfixturevalue(checkpoint))
    generations = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    expected = [greedy_reference(reference, prompt, MAX_NEW) for prompt in PROMPTS]
    assert _tokens(generations) == expected
    assert [g.prompt_index for g in generations] == list(range(len(PROMPTS)))
    assert all(g.finish_reason == "length" for g in generations)

    # transformers on the same left-padded batch agrees too.
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    batched = reference.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                                 eos_token_id=None, pad_token_id=0)
    assert _tokens(generations) == batched[:, width:].tolist()


def test_greedy_stops_where_transformers_stops(engine, reference):
    unstopped = _tokens(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW)))
    stop = unstopped[0][4]  # a token prompt 0 emits mid-response
    generations = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                          stop_token_ids=[stop]))
    for prompt, generation, full in zip(PROMPTS, generations, unstopped):
        assert generation.response_token_ids == greedy_reference(reference, prompt, MAX_NEW, stop_token_id=stop)
        if stop in full:
            assert generation.finish_reason == "stop"
            assert generation.response_token_ids == full[:full.index(stop) + 1]  # the stop token is kept
        else:
            assert generation.finish_reason == "length" and generation.response_token_ids == full
    assert generations[0].finish_reason == "stop" and len(generations[0].response_token_ids) <= 5


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=2, seed=7),
    SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=MAX_NEW, n=2, seed=8),
    SamplingParams(temperature=0, max_new_tokens=MAX_NEW),
], ids=["plain", "filtered", "greedy"])
def test_logprobs_are_tempered_logprobs_of_a_teacher_forced_pass(engine, reference, sampling):
    generations = engine.generate(PROMPTS, sampling)
    for generation in generations:
        prompt = PROMPTS[generation.prompt_index]
        assert len(generation.logprobs) == len(generation.response_token_ids) == MAX_NEW
        expected = teacher_forced_logprobs(reference, prompt, generation.response_token_ids,
                                           temperature=sampling.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_a_fixed_seed_repeats_and_other_seeds_differ(engine):
    def sample(seed):
        return _tokens(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed)))

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


def test_n_gives_n_distinct_samples_per_prompt_in_prompt_major_order(engine):
    generations = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=3, seed=0))
    assert [g.prompt_index for g in generations] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for i in range(len(PROMPTS)):
        samples = [tuple(g.response_token_ids) for g in generations[3 * i:3 * i + 3]]
        assert len(set(samples)) > 1


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=MAX_NEW, n=2))
    assert _tokens(top1) == [g.response_token_ids for g in greedy for _ in range(2)]


def test_per_prompt_params_mix_greedy_sampling_and_lengths_in_one_batch(engine):
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=11)
    mixed = engine.generate(PROMPTS[:2], [greedy, sampled])
    assert _tokens(mixed[:1]) == _tokens(engine.generate(PROMPTS[:1], greedy))
    assert [len(g.response_token_ids) for g in mixed] == [MAX_NEW, 5, 5]
    assert all(g.finish_reason == "length" for g in mixed)
    # A seeded request draws the same tokens whatever else shares its batch (here: more padding).
    other = engine.generate([PROMPTS[2], PROMPTS[1]], [SamplingParams(temperature=0, max_new_tokens=1), sampled])
    assert _tokens(other[1:]) == _tokens(mixed[1:])


def test_request_errors_are_clear(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 100\)"):
        engine.generate([[100]], SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[1]], SamplingParams(stop_token_ids=[100]))
    with pytest.raises(ValueError, match=r"prompt 0 \(3 tokens\) \+ max_new_tokens 126 exceeds .* 128"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=126))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1]], [SamplingParams(), SamplingParams()])
    assert engine.generate([], SamplingParams()) == []


def test_each_prompt_is_prefilled_once_for_its_samples(engine, reference):
    rows = []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        generations = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=4, n=3, seed=2))
    finally:
        hook.remove()
    assert rows == [len(PROMPTS)] + [3 * len(PROMPTS)] * 3  # the prefill, then one step per token for every sample
    for generation in generations:  # every sample decodes from its prompt's shared cache
        expected = teacher_forced_logprobs(reference, PROMPTS[generation.prompt_index], generation.response_token_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)

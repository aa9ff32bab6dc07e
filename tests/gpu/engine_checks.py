"""Checks shared by the real-engine GPU tests: the adapter against HFEngine on the same GPU."""

import torch
from safetensors.torch import load_file

from rlmega.rollout import EngineNotReadyError, HFEngine, SamplingParams

from .conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
# fp32 on both sides; kernels differ (paged attention vs eager), so the log-probs agree to ~1e-4, not bits.
LOGPROB_ATOL = 2e-3


def tensors(directory):
    return sorted(load_file(next(directory.glob("*.safetensors"))).items())


def reference(directory, device="cuda"):
    return HFEngine(directory, dtype=torch.float32, device=device, attn_implementation="eager")


def assert_matches(actual, expected):
    assert [g.response_token_ids for g in actual] == [g.response_token_ids for g in expected]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), atol=LOGPROB_ATOL, rtol=0)


def check_greedy_and_sampled_logprobs(engine, directory):
    hf = reference(directory)
    assert_matches(engine.generate(PROMPTS, GREEDY), hf.generate(PROMPTS, GREEDY))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=16, n=4, seed=1))
    assert [g.prompt_index for g in sampled] == [i for i in range(len(PROMPTS)) for _ in range(4)]
    for g in sampled:  # log-probs of the logits / temperature: re-scored by HF teacher forcing
        tokens = torch.tensor([PROMPTS[g.prompt_index] + g.response_token_ids], device="cuda")
        with torch.no_grad():
            logits = hf.model(tokens).logits[0, len(PROMPTS[g.prompt_index]) - 1:-1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, tokens[0, -len(g.response_token_ids):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), expected.cpu(), atol=LOGPROB_ATOL, rtol=0)


def check_update_sleep_wake(engine, directory, other_directory):
    before = engine.generate(PROMPTS, GREEDY)
    engine.update_weights(iter(tensors(other_directory)), version=1)
    after = engine.generate(PROMPTS, GREEDY)
    assert [g.response_token_ids for g in after] != [g.response_token_ids for g in before]
    assert_matches(after, reference(other_directory).generate(PROMPTS, GREEDY))
    engine.sleep(level=2)
    try:
        engine.generate(PROMPTS, GREEDY)
        raise AssertionError("generate ran while asleep")
    except EngineNotReadyError:
        pass
    engine.update_weights(iter(tensors(directory)), version=2)  # wakes the weights only, then writes them
    engine.wake()
    assert engine.weight_version() == 2 and engine.health()["ready"]
    assert_matches(engine.generate(PROMPTS, GREEDY), before)


def check_top_k_logprobs_are_truncated(engine, directory, device="cuda"):
    """vLLM's log-probs under top-k are those of the truncated distribution it samples from
    (``processed_logprobs``: log_softmax over the k kept logits / T), not the full one the trainer scores: what
    rlmega refuses with bypass_mode and reports as ``mismatch/truncated_logprobs`` (rlmega/config/engine_sampling.py).
    The CPU twin runs it on the fake (tests/rollout/test_vllm_adapter.py)."""
    hf, k, temperature = reference(directory, device), 5, 0.7
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=temperature, top_k=k, max_new_tokens=8, seed=2))
    for g in sampled:
        tokens = torch.tensor([PROMPTS[g.prompt_index] + g.response_token_ids], device=device)
        with torch.no_grad():
            logits = hf.model(tokens).logits[0, len(PROMPTS[g.prompt_index]) - 1:-1].float() / temperature
        kept = logits.masked_fill(logits < logits.topk(k, dim=-1).values[:, -1:], float("-inf"))
        response = tokens[0, -len(g.response_token_ids):, None]
        truncated = torch.log_softmax(kept, -1).gather(-1, response)[:, 0]
        full = torch.log_softmax(logits, -1).gather(-1, response)[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), truncated.cpu(), atol=LOGPROB_ATOL, rtol=0)
        assert bool((truncated - full > LOGPROB_ATOL).all()), "the truncation should raise every token's log-prob"

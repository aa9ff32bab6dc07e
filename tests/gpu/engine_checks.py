"""Checks shared by the real-engine GPU tests: the adapter against HFEngine (or a fresh engine) on the same GPU.
Each takes its engines from the caller, so its CPU contract twin runs the same body on the fakes."""

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlmega.rollout import EngineNotReadyError, HFEngine, SamplingParams

from .conftest import PROMPTS
from .measures import measured

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
# fp32 on both sides; kernels differ (paged attention vs eager), so the log-probs agree to ~1e-4, not bits.
LOGPROB_ATOL = 2e-3


# Long enough that vLLM caches whole blocks of them (16 tokens a block) and SGLang's radix tree holds them; ids
# every tiny checkpoint has (the CPU fakes' vocabulary is 100).
CACHED_PROMPTS = [[3 + (7 * row + column) % 90 for column in range(40)] for row in range(2)]


def tensors(directory):
    return sorted(load_file(next(Path(directory).glob("*.safetensors"))).items())


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


def check_data_parallel_is_refused(llm_class, directory):
    """vLLM refuses ``LLM(data_parallel_size=2)`` in one process (vllm/entrypoints/llm.py, LLM.__init__), and
    rlmega's config check refuses ``rollout.data_parallel_size=2`` before any engine starts, naming the
    ``rollout.num_engines`` that runs the replicas as separate engines. ``llm_class``: ``vllm.LLM`` (the fake's on
    CPU)."""
    from rlmega.config import load_config
    from rlmega.config.engine_layout import layout_problems

    try:
        llm_class(str(directory), data_parallel_size=2, gpu_memory_utilization=0.3, enforce_eager=True,
                  max_model_len=256)
    except ValueError as error:
        assert "LLM(data_parallel_size=2) is not supported for single-process usage" in str(error), error
    else:
        raise AssertionError("vLLM built an LLM with data_parallel_size=2 in one process")
    config = load_config("tiny_cpu", ["rollout.backend=vllm", "rollout.data_parallel_size=2",
                                      "rollout.num_engines=1"], check=False)
    problems = dict(layout_problems(config))
    assert "set rollout.data_parallel_size=1 and rollout.num_engines=2" in problems["rollout.data_parallel_size"]


def check_update_drops_the_prefix_cache(engine, fresh_engine, other_directory):
    """Generate (the old weights' KV is cached), update to other weights, generate the same prompts: the
    log-probs equal those of ``fresh_engine(other_directory)``, an engine that never saw the old weights, so no
    KV of the old weights was reused (rlmega drops the prefix cache at every update and fails the update when the
    engine keeps it)."""
    before = engine.generate(CACHED_PROMPTS, GREEDY)
    engine.update_weights(iter(tensors(other_directory)), version=(engine.weight_version() or 0) + 1)
    after = engine.generate(CACHED_PROMPTS, GREEDY)
    expected = fresh_engine(other_directory).generate(CACHED_PROMPTS, GREEDY)
    assert [g.response_token_ids for g in after] != [g.response_token_ids for g in before]
    assert_matches(after, expected)
    worst = max(abs(a - e) for x, y in zip(after, expected) for a, e in zip(x.logprobs, y.logprobs))
    measured(worst_logprob_diff_vs_fresh=worst)


def check_multimodal_engine_with_its_tokenizer(make_engine, directory):
    """A vision-language checkpoint (a tiny Qwen2.5-VL with its tokenizer and image processor,
    rlmega.trainer.vlm_assets) starts as a vLLM engine, which builds its multimodal processor with the tokenizer,
    and generates token ids in and out, with and without an image."""
    from PIL import Image
    from transformers import AutoTokenizer

    from rlmega.data.images import ImagePrompts

    tokenizer = AutoTokenizer.from_pretrained(directory)
    engine = make_engine(directory)
    prompts = ImagePrompts(str(directory), tokenizer)
    image = Image.new("RGB", (16, 16), (220, 40, 40))
    with_image, inputs = prompts(f"{prompts.markup}Colour?", [image], min_pixels=None, max_pixels=None,
                                 add_special_tokens=True)
    ids = [tokenizer("Colour?")["input_ids"], with_image]
    generations = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=4), images=[None, inputs])
    assert [g.prompt_index for g in generations] == [0, 1]
    for g in generations:
        assert g.response_token_ids and all(isinstance(t, int) and 0 <= t < len(tokenizer)
                                            for t in g.response_token_ids)
        assert len(g.logprobs) == len(g.response_token_ids) and all(math.isfinite(lp) for lp in g.logprobs)
    measured(image_prompt_tokens=len(with_image), response_tokens=sum(len(g.response_token_ids) for g in generations))


def host_copy_gb_per_s(megabytes: int = 1024, repeats: int = 5) -> float:
    """One thread copying a large host buffer into another, best of ``repeats`` (GB/s): what vLLM's
    collective_rpc does with every weight bucket, once per worker of a TP > 1 engine (the refit plan's
    ``plan.host_copy_gb_per_s``)."""
    import time

    import numpy as np

    source = np.ones(megabytes << 20, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch every page first
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    speed = source.nbytes / best / 1e9
    measured(host_copy_gb_per_s=speed, set_it_as=f"plan.host_copy_gb_per_s={speed:.1f}")
    return speed

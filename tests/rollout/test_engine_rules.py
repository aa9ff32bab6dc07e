"""The pinned engines' validation rules that rlmega can trip (fakes/api/rules.json, each cited from its wheel), met
by the fakes as the wheels meet them, and rlmega's answers: data parallelism as separate engines, a prefix cache
that must really be dropped after a weight update, vLLM's top_k=1 log-probs, its 0.34 memory default, and a
context length below prompt + response."""

import sys
import warnings

import pytest
import torch

from rlmega.config import ConfigError, load_config
from rlmega.config.load import check_settings
from rlmega.rollout.protocol import EngineNotReadyError

from .fakes import api_snapshot, contract, fake_sglang, fake_vllm, one_thread
from .tiny_models import PROMPTS, checkpoint_tensors

ON_GPUS = ["rollout.placement=colocated", "rollout.gpus_per_engine=0", "cluster.gpus_per_rank=1"]
RECIPE_235B = "configs/recipes/qwen3_235b_a22b/grpo.yaml"


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        from rlmega.rollout.sglang_engine import SGLangEngine
        from rlmega.rollout.vllm_engine import VLLMEngine

        yield {"vllm": lambda path, **kw: VLLMEngine(path, **kw), "sglang": lambda path, **kw: SGLangEngine(path, **kw)}


@pytest.fixture
def settings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def check(*overrides, config="tiny_cpu"):
        loaded = load_config(config, list(overrides), check=False)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            check_settings(loaded)
        return loaded

    return check


def test_every_rule_cites_its_wheel():
    for package in ("vllm", "sglang"):
        rules = api_snapshot._rules()[package]
        assert rules and all(rule["where"] and rule["releases"] for rule in rules.values()), package


# ---------------------------------------------------------------------------------------------- data parallelism

def test_data_parallel_engines_are_refused_by_the_wheels_as_the_fakes_show(engines, llama_dir):
    with pytest.raises(ValueError, match=r"LLM\(data_parallel_size=2\) is not supported for single-process usage"):
        engines["vllm"](llama_dir, data_parallel_size=2)
    sglang = engines["sglang"](llama_dir, dp_size=2)  # starts ...
    with pytest.raises(AssertionError, match="data-parallel replicas are not supported for update weights from tensor"):
        sglang.update_weights(checkpoint_tensors(llama_dir).items(), version=1)  # ... and fails at the first update


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_data_parallel_size_is_refused_at_load_naming_num_engines(settings, backend):
    with pytest.raises(ConfigError, match=r"rollout.data_parallel_size: .* set rollout.data_parallel_size=1 and "
                                          r"rollout.num_engines=6"):
        settings(f"rollout.backend={backend}", *ON_GPUS, "rollout.tensor_parallel_size=1",
                 "rollout.data_parallel_size=2", "rollout.num_engines=3")


def test_the_235b_recipe_builds_its_engines_under_the_wheels_rules(settings, engines, llama_dir):
    rollout = settings(config=RECIPE_235B).rollout
    assert rollout.data_parallel_size == 1 and rollout.gpus_of_one_engine <= 8  # an engine on one node
    arguments = rollout.engine_arguments()
    arguments.pop("enable_expert_parallel")  # the tiny dense checkpoint has no experts
    engine = engines["vllm"](llama_dir, **arguments)
    assert engine.llm.engine_args["tensor_parallel_size"] == rollout.tensor_parallel_size


# ---------------------------------------------------------------------------------------------- prefix cache

def _busy(engine, backend: str, times: int) -> None:
    if backend == "vllm":
        engine.llm.busy_resets = times
    else:
        engine.engine.busy_flushes = times


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_refused_cache_drop_is_retried_until_the_engine_is_idle(engines, llama_dir, llama_other_dir, backend):
    engine = engines[backend](llama_dir)
    stale = engine.generate(PROMPTS[:2], contract.GREEDY)
    _busy(engine, backend, 2)
    engine.update_weights(checkpoint_tensors(llama_other_dir).items(), version=1)
    fresh = engine.generate(PROMPTS[:2], contract.GREEDY)
    assert [g.logprobs for g in fresh] != [g.logprobs for g in stale]  # the new weights' KV, not the cached one
    drops = [call for call in (engine.llm if backend == "vllm" else engine.engine).calls
             if call[0] in ("reset_prefix_cache", "flush_cache")]
    assert len(drops) == 3


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_cache_that_is_never_dropped_fails_the_update_naming_the_engine(engines, llama_dir, llama_other_dir,
                                                                          backend, monkeypatch):
    from rlmega.rollout import engine_common

    monkeypatch.setattr(engine_common, "PREFIX_CACHE_TIMEOUT_S", 0.2)
    engine = engines[backend](llama_dir)
    engine.generate(PROMPTS[:1], contract.GREEDY)
    _busy(engine, backend, 10**9)
    with pytest.raises(RuntimeError, match=rf"the {backend} engine of .* kept its prefix cache after the update to "
                                           r"weight version 1"):
        engine.update_weights(checkpoint_tensors(llama_other_dir).items(), version=1)
    with pytest.raises(EngineNotReadyError, match="weight version 1"):
        engine.generate(PROMPTS[:1], contract.GREEDY)
    _busy(engine, backend, 0)
    engine.update_weights(checkpoint_tensors(llama_other_dir).items(), version=2)  # once idle, an update succeeds
    assert engine.health()["ready"]


def _stale_cache_check(rank, world_size, source_dir, target_dir, keeps_cache):
    from rlmega.bridge import load_hf_weights
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, initialize
    from rlmega.sync import WeightSyncError, post_sync_check
    from rollout.fakes import fake_vllm as fake
    from rollout.tiny_models import checkpoint_tensors as tensors

    sys.modules["vllm"] = fake
    from rlmega.rollout.vllm_engine import VLLMEngine

    initialize(ParallelLayout(world_size=1))
    spec = model_spec_from_hf(target_dir)
    chunks = build_chunks(spec, ParallelLayout(world_size=1))
    load_hf_weights(chunks, spec, target_dir)
    engine = VLLMEngine(source_dir)
    engine.generate(PROMPTS, contract.GREEDY)  # the probes' KV, cached under the old weights
    if keeps_cache:  # an engine that reports the cache dropped and keeps it
        engine.llm.reset_prefix_cache = lambda *args, **kwargs: True
    engine.update_weights(tensors(target_dir).items(), version=1)
    try:
        return post_sync_check(chunks, spec, engine, PROMPTS, version=1, atol=1e-3)
    except WeightSyncError as error:
        return str(error)


def test_the_post_sync_check_catches_a_prefix_cache_kept_from_the_old_weights(llama_dir, llama_other_dir):
    from rlmega.parallel.spawn import run_on_ranks

    (kept,) = run_on_ranks(_stale_cache_check, 1, timeout_s=240, args=(str(llama_dir), str(llama_other_dir), True))
    assert "post-sync check failed" in kept
    (dropped,) = run_on_ranks(_stale_cache_check, 1, timeout_s=240,
                              args=(str(llama_dir), str(llama_other_dir), False))
    assert dropped <= 1e-3


# ---------------------------------------------------------------------------------------------- sampling, memory, length

def test_vllm_top_k_1_log_probs_are_exactly_zero_and_refused_at_load(engines, llama_dir, settings):
    engine = engines["vllm"](llama_dir)
    (generation,) = engine.generate(PROMPTS[:1], contract.SamplingParams(temperature=1.0, top_k=1, max_new_tokens=4))
    assert generation.logprobs == [0.0] * len(generation.logprobs)  # vllm/v1/sample/sampler.py, processed
    with pytest.raises(ConfigError, match=r"rollout.top_k: top_k=1 at temperature 1.0 with vLLM .* exactly 0.0"):
        settings("rollout.backend=vllm", *ON_GPUS, "rollout.top_k=1")
    settings("rollout.backend=vllm", *ON_GPUS, "rollout.top_k=1", "rollout.temperature=0")
    settings("rollout.backend=sglang", *ON_GPUS, "rollout.top_k=1")  # SGLang's log-probs are of the full distribution


def test_a_vllm_engine_built_without_a_memory_share_does_not_take_the_whole_gpu_on_0_34(engines, llama_dir,
                                                                                      monkeypatch):
    monkeypatch.setattr(fake_vllm, "__version__", "0.34.0")
    assert fake_vllm.LLM(str(llama_dir)).gpu_memory_utilization == 1.0  # the 0.34 wheel's default
    assert engines["vllm"](llama_dir).llm.gpu_memory_utilization < 1.0


@pytest.mark.parametrize("backend, argument", [("vllm", "max_model_len"), ("sglang", "context_length")])
def test_a_context_length_below_prompt_plus_response_is_refused_at_load(settings, backend, argument):
    with pytest.raises(ConfigError, match=rf"rollout.engine_kwargs.{argument}: 8 is below data.max_prompt_length "
                                          r"\+ rollout.max_new_tokens = \d+"):
        settings(f"rollout.backend={backend}", *ON_GPUS, f"+rollout.engine_kwargs.{argument}=8")


def test_vllm_cuts_a_response_at_max_model_len_as_the_fake_shows(engines, llama_dir):
    engine = engines["vllm"](llama_dir, max_model_len=8)
    with pytest.raises(RuntimeError, match="ended a response after 3 of 16 tokens"):  # cut at 8 - 5 tokens
        engine.generate(PROMPTS[:1], contract.SamplingParams(temperature=0.0, max_new_tokens=16))
    with pytest.raises(ValueError, match=r"prompt \(length 11\) is longer than the maximum model length of 8"):
        engine.generate(PROMPTS[2:3], contract.GREEDY)

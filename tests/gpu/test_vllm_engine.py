"""The real vLLM 0.33 behind VLLMEngine on a tiny Llama, Qwen2 and Qwen3-MoE: greedy equals HF, temperature-scaled
log-probs; on the Llama, weight updates and sleep/wake. Needs CUDA and `pip install -e .[vllm]` (tests/gpu/run_gpu_checks.sh)."""

import gc

import pytest

from .conftest import ENGINE_MODELS
from .engine_checks import (check_greedy_and_sampled_logprobs, check_top_k_logprobs_are_truncated,
                            check_update_sleep_wake)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=ENGINE_MODELS)
def engine(request, gpu_model_dirs):
    """One engine per model kind, each in turn (a module-scoped parametrized fixture is torn down before the
    next kind's starts)."""
    pytest.importorskip("vllm")
    from rlmega.rollout.vllm_engine import VLLMEngine

    gc.collect()  # the previous kind's engine, released by pytest: its engine-core process ends with it

    engine = VLLMEngine(gpu_model_dirs(request.param), dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                        max_model_len=256)
    engine.kind = request.param
    return engine


def test_greedy_and_logprobs_match_hf(engine, gpu_model_dirs):
    check_greedy_and_sampled_logprobs(engine, gpu_model_dirs(engine.kind))


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir):
    check_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir)


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_top_k_logprobs_are_of_the_truncated_distribution(engine, gpu_llama_dir):
    check_top_k_logprobs_are_truncated(engine, gpu_llama_dir)

"""The real vLLM 0.33 behind VLLMEngine on a tiny Llama, Qwen2 and Qwen3-MoE: greedy equals HF, temperature-scaled
log-probs; on the Llama, weight updates and sleep/wake, the prefix cache of the old weights gone after an update,
an engine's data parallelism refused; a tiny Qwen2.5-VL served with its tokenizer. Needs CUDA and
`pip install -e .[vllm]` (tests/gpu/run_gpu_checks.sh). CPU contract twins: tests/rollout/test_gpu_check_twins.py."""

import gc

import pytest

from .conftest import ENGINE_MODELS
from .engine_checks import (check_data_parallel_is_refused, check_greedy_and_sampled_logprobs,
                            check_multimodal_engine_with_its_tokenizer, check_top_k_logprobs_are_truncated,
                            check_update_drops_the_prefix_cache, check_update_sleep_wake)

pytestmark = pytest.mark.gpu
ENGINE_KWARGS = dict(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=256)


@pytest.fixture(scope="module", params=ENGINE_MODELS)
def engine(request, gpu_model_dirs):
    """One engine per model kind, each in turn (a module-scoped parametrized fixture is torn down before the
    next kind's starts)."""
    pytest.importorskip("vllm")
    from rlmega.rollout.vllm_engine import VLLMEngine

    gc.collect()  # the previous kind's engine, released by pytest: its engine-core process ends with it

    engine = VLLMEngine(gpu_model_dirs(request.param), **ENGINE_KWARGS)
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


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_an_update_drops_the_prefix_cache_of_the_old_weights(engine, gpu_llama_other_dir):
    from rlmega.rollout.vllm_engine import VLLMEngine

    check_update_drops_the_prefix_cache(engine, lambda path: VLLMEngine(path, **ENGINE_KWARGS), gpu_llama_other_dir)


def test_data_parallel_is_refused(gpu_llama_dir):
    vllm = pytest.importorskip("vllm")
    check_data_parallel_is_refused(vllm.LLM, gpu_llama_dir)


def test_a_multimodal_engine_starts_with_its_tokenizer(tmp_path):
    pytest.importorskip("vllm")
    from rlmega.rollout.vllm_engine import VLLMEngine
    from rlmega.trainer.vlm_assets import prepare_tiny_vlm_assets

    gc.collect()
    model = prepare_tiny_vlm_assets(tmp_path, num_train=2, num_val=2)["model"]  # built here, from a config
    check_multimodal_engine_with_its_tokenizer(
        lambda path: VLLMEngine(path, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True,
                                max_model_len=64), model)

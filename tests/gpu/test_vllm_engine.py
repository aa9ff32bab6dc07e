"""The real vLLM 0.33 behind VLLMEngine on a tiny Llama: greedy equals HF, temperature-scaled log-probs, weight updates,
sleep/wake. Needs CUDA and `pip install -e .[vllm]` (tests/gpu/run_gpu_checks.sh)."""

import pytest

from .engine_checks import check_greedy_and_sampled_logprobs, check_update_sleep_wake

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(gpu_llama_dir):
    pytest.importorskip("vllm")
    from rlmega.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(gpu_llama_dir, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                      max_model_len=256)


def test_greedy_and_logprobs_match_hf(engine, gpu_llama_dir):
    check_greedy_and_sampled_logprobs(engine, gpu_llama_dir)


def test_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir):
    check_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir)

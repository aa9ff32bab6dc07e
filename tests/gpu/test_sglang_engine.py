"""The real SGLang 0.5.3 behind SGLangEngine on a tiny Llama: greedy equals HF, temperature-scaled log-probs (without
RETURN_ORIGINAL_LOGPROB), weight updates, sleep/wake. Needs CUDA and `pip install -e .[sglang]`
(tests/gpu/run_gpu_checks.sh)."""

import pytest

from .engine_checks import check_greedy_and_sampled_logprobs, check_update_sleep_wake

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(gpu_llama_dir):
    pytest.importorskip("sglang")
    from rlmega.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(gpu_llama_dir, dtype="float32", mem_fraction_static=0.3, disable_cuda_graph=True,
                          enable_deterministic_inference=True, sampling_backend="pytorch")
    yield engine
    engine.shutdown()


def test_greedy_and_logprobs_match_hf(engine, gpu_llama_dir):
    check_greedy_and_sampled_logprobs(engine, gpu_llama_dir)


def test_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir):
    check_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir)

"""The real SGLang 0.5.23 behind SGLangEngine on a tiny Llama, Qwen2 and Qwen3-MoE: greedy equals HF,
temperature-scaled log-probs (without SGLANG_RETURN_ORIGINAL_LOGPROB); on the Llama, weight updates and
sleep/wake, and the prefix cache of the old weights gone after an update (twin: tests/rollout/test_gpu_check_twins.py).
Needs CUDA and `pip install -e .[sglang]`
(tests/gpu/run_gpu_checks.sh). Its CPU contract twin, test_the_gpu_fixture_arguments_are_accepted in
tests/rollout/test_sglang_adapter.py, builds the fake engine with ENGINE_KWARGS."""

import pytest

from .conftest import ENGINE_MODELS
from .engine_checks import (check_greedy_and_sampled_logprobs, check_update_drops_the_prefix_cache,
                            check_update_sleep_wake)

pytestmark = pytest.mark.gpu

# Deterministic inference (per-request seeds) needs an attention backend from
# DETERMINISTIC_ATTENTION_BACKEND_CHOICES; left unset, SGLang picks fa3 on Hopper, which has no fp32 kernels.
ENGINE_KWARGS = dict(dtype="float32", mem_fraction_static=0.3, disable_cuda_graph=True,
                     enable_deterministic_inference=True, attention_backend="triton", sampling_backend="pytorch")


@pytest.fixture(scope="module", params=ENGINE_MODELS)
def engine(request, gpu_model_dirs):
    """One engine per model kind, each in turn (a module-scoped parametrized fixture is torn down before the
    next kind's starts)."""
    pytest.importorskip("sglang")
    from rlmega.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(gpu_model_dirs(request.param), **ENGINE_KWARGS)
    engine.kind = request.param
    yield engine
    engine.shutdown()


def test_greedy_and_logprobs_match_hf(engine, gpu_model_dirs):
    check_greedy_and_sampled_logprobs(engine, gpu_model_dirs(engine.kind))


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir):
    check_update_sleep_wake(engine, gpu_llama_dir, gpu_llama_other_dir)


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_an_update_drops_the_prefix_cache_of_the_old_weights(engine, gpu_llama_other_dir):
    from rlmega.rollout.sglang_engine import SGLangEngine

    fresh = []

    def fresh_engine(path):
        fresh.append(SGLangEngine(path, **ENGINE_KWARGS))
        return fresh[-1]

    try:
        check_update_drops_the_prefix_cache(engine, fresh_engine, gpu_llama_other_dir)
    finally:
        for other in fresh:
            other.shutdown()

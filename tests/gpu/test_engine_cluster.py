"""Cluster tier, per installed engine (tests/gpu/run_gpu_checks.sh --tier cluster): a Megatron actor and a
real vLLM / SGLang engine on one GPU, in this process. After a sync the engine's log-probs equal the
trainer's, for a tiny Llama, Qwen2 and Qwen3-MoE (the post-sync check, fp32 on both sides, LOGPROB_ATOL as in engine_checks.py); sleep -> sync ->
wake twice brings the device's free memory back to where it was awake, within MEMORY_SLACK_BYTES (the
caching allocators' rounding), and the second cycle leaks nothing the first did not.

The CPU contract of this path (push_weights in-process, then post_sync_check) is
test_sync_contract_on_cpu in test_minimal_tier.py, with the hf engine in the engine's place.
"""

import gc

import pytest
import torch

from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import free_port
from rlmega.sync import post_sync_check, push_weights, require_version

from .conftest import ENGINE_MODELS, PROMPTS
from .engine_checks import LOGPROB_ATOL
from .minimal_checks import actor, train_once

pytestmark = pytest.mark.gpu

MEMORY_SLACK_BYTES = 256 << 20


def _vllm(directory):
    pytest.importorskip("vllm")
    from rlmega.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(directory, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=256)


def _sglang(directory):
    pytest.importorskip("sglang")
    from rlmega.rollout.sglang_engine import SGLangEngine

    from .test_sglang_engine import ENGINE_KWARGS

    return SGLangEngine(directory, **ENGINE_KWARGS)


ENGINES = {"vllm": _vllm, "sglang": _sglang}


@pytest.fixture
def kind():
    """The model kind of a test (``conftest.CONFIGS``); tests parametrize it."""
    return "llama"


@pytest.fixture
def trained_actor(monkeypatch, gpu_model_dirs, kind):
    """An fp32 actor on cuda:0 after one update, so its weights are neither checkpoint's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    initialize(ParallelLayout())
    worker = actor(gpu_model_dirs(kind), "fp32")
    train_once(worker)
    yield worker
    destroy(including_default_group=True)


@pytest.fixture(params=sorted(ENGINES))
def engine(request, gpu_model_dirs, kind, trained_actor):
    gc.collect()  # the previous test's engine: vLLM's engine-core process ends with its last reference
    engine = ENGINES[request.param](gpu_model_dirs(kind, 1))  # other weights than the actor's
    yield engine
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()


def _free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("kind", ENGINE_MODELS)
def test_engine_logprobs_equal_the_trainer_after_sync(trained_actor, engine):
    push_weights(trained_actor.chunks, trained_actor.spec, engine, version=1, transport="in_process")
    require_version(engine, 1)
    worst = post_sync_check(trained_actor.chunks, trained_actor.spec, engine, PROMPTS, atol=LOGPROB_ATOL, version=1)
    assert worst <= LOGPROB_ATOL


def test_sleep_sync_wake_returns_memory_to_baseline(trained_actor, engine):
    awake = _free_bytes()
    after_cycles = []
    for version in (1, 2):
        engine.sleep(level=1)
        asleep = _free_bytes()
        assert asleep > awake + MEMORY_SLACK_BYTES, (asleep, awake)  # weights and KV cache left the device
        push_weights(trained_actor.chunks, trained_actor.spec, engine, version=version, transport="in_process")
        engine.wake()
        require_version(engine, version)
        after_cycles.append(_free_bytes())
        assert abs(after_cycles[-1] - awake) <= MEMORY_SLACK_BYTES, (after_cycles[-1], awake)
        post_sync_check(trained_actor.chunks, trained_actor.spec, engine, PROMPTS, atol=LOGPROB_ATOL, version=version)
    assert after_cycles[1] >= after_cycles[0] - MEMORY_SLACK_BYTES // 4, after_cycles

"""CPU contract twins of the cluster tier's engine checks (tests/gpu/engine_checks.py): the same bodies on the fake
engines, which refuse and cache as the wheels do (fakes/api/rules.json), and each shown to fail where the engine
misbehaves."""

import sys

import pytest

from .fakes import fake_sglang, fake_vllm, one_thread


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        yield


def _engines():
    from rlmega.rollout.sglang_engine import SGLangEngine
    from rlmega.rollout.vllm_engine import VLLMEngine

    return {"vllm": lambda path: VLLMEngine(path, gpu_memory_utilization=0.3),
            "sglang": lambda path: SGLangEngine(path, mem_fraction_static=0.3)}


def test_data_parallel_check(fakes, llama_dir):
    from gpu.engine_checks import check_data_parallel_is_refused

    check_data_parallel_is_refused(fake_vllm.LLM, llama_dir)

    def accepting(path, data_parallel_size, **kwargs):  # a release that would take it
        return fake_vllm.LLM(path, **kwargs)

    with pytest.raises(AssertionError, match="built an LLM with data_parallel_size=2"):
        check_data_parallel_is_refused(accepting, llama_dir)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_prefix_cache_check(fakes, llama_dir, llama_other_dir, backend):
    from gpu.engine_checks import check_update_drops_the_prefix_cache

    make = _engines()[backend]
    check_update_drops_the_prefix_cache(make(llama_dir), make, llama_other_dir)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_prefix_cache_check_fails_on_an_engine_that_keeps_its_cache(fakes, llama_dir, llama_other_dir, backend,
                                                                    monkeypatch):
    from gpu.engine_checks import check_update_drops_the_prefix_cache

    make = _engines()[backend]
    engine = make(llama_dir)
    if backend == "vllm":  # reports the cache dropped and keeps it
        monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *args, **kwargs: True)
    else:
        monkeypatch.setattr(engine.engine, "flush_cache", lambda: fake_sglang.FlushCacheReqOutput(success=True))
    with pytest.raises(AssertionError):
        check_update_drops_the_prefix_cache(engine, make, llama_other_dir)


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    from rlmega.trainer.vlm_assets import prepare_tiny_vlm_assets

    return prepare_tiny_vlm_assets(tmp_path_factory.mktemp("tiny_vl"), num_train=2, num_val=2)["model"]


def test_multimodal_check(fakes, tiny_vl_dir):
    from gpu.engine_checks import check_multimodal_engine_with_its_tokenizer

    from rlmega.rollout.vllm_engine import VLLMEngine

    built = []

    def make(path):
        built.append(VLLMEngine(path, gpu_memory_utilization=0.3))
        return built[-1]

    check_multimodal_engine_with_its_tokenizer(make, tiny_vl_dir)
    (engine,) = built
    assert engine.llm.calls[0][2]["skip_tokenizer_init"] is False
    (requests,) = engine.llm.mm_requests
    assert requests[0] is None and requests[1]["pixel_values"] is not None  # the image reached the processor


def test_host_copy_measure_names_the_plan_setting(monkeypatch, tmp_path):
    from gpu.engine_checks import host_copy_gb_per_s
    from gpu.measures import ENV

    monkeypatch.setenv(ENV, str(tmp_path / "measures"))
    speed = host_copy_gb_per_s(megabytes=16, repeats=2)
    line = (tmp_path / "measures").read_text()
    assert speed > 0.1 and line.startswith("host_copy_gb_per_s=")
    assert f"set_it_as=plan.host_copy_gb_per_s={speed:.1f}" in line

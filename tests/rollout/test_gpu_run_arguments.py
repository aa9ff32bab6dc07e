"""CPU contract twin of tests/gpu/test_trainer_gpu.py: each of its GPU runs' configs loads and validates (this
machine declared to have two GPUs), runs its post-sync check at the bf16 tolerance, and the engine accepts
exactly the arguments the trainer gives it (``rlmega.trainer.rollout_group._engine``): the fakes check every
argument against the API snapshot of the pinned wheel, so a renamed or dropped one fails here."""

import sys

import pytest
import torch

from rlmega.config import load_config
from rlmega.config.schema import POST_SYNC_ATOL_BF16
from rlmega.trainer.rollout_group import _engine

from .fakes import fake_sglang, fake_vllm, one_thread

FAKES = {"vllm": fake_vllm, "sglang": fake_sglang}


@pytest.fixture
def gpu_run_config(tmp_path, monkeypatch, tiny_assets):
    """``gpu_run_config(backend, placement, *more_overrides)``: the config of tests/gpu/test_trainer_gpu.py's run, with
    the fake engine installed and four GPUs declared on this machine."""
    from gpu.test_trainer_gpu import run_overrides

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv(fake_sglang.RAW_LOGPROB_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "assets").symlink_to(tiny_assets(num_train=16, num_val=8))

    def config(backend, placement, *overrides):
        monkeypatch.setitem(sys.modules, backend, FAKES[backend])
        return load_config("tiny_cpu", ["tiny_assets=true", *run_overrides(backend, placement, run_dir), *overrides])

    return config


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("backend", sorted(FAKES))
def test_the_gpu_runs_configs_and_engine_arguments_are_accepted(gpu_run_config, backend, placement):
    from gpu.test_trainer_gpu import ENGINE_KWARGS, PLACEMENTS

    assert sorted(ENGINE_KWARGS) == sorted(FAKES) and sorted(PLACEMENTS) == ["colocated", "disaggregated"]
    config = gpu_run_config(backend, placement)
    assert config.rollout.backend == backend and config.rollout.placement == placement
    assert config.post_sync_atol() == POST_SYNC_ATOL_BF16
    engine_class, arguments = _engine(config)
    assert engine_class.__name__ == {"vllm": "VLLMEngine", "sglang": "SGLangEngine"}[backend]
    with one_thread():
        engine = engine_class(config.model.path, **arguments)
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("engine_gpus, backend", [(1, None), (2, "mp")])
def test_a_vllm_engine_over_several_gpus_runs_its_own_processes(gpu_run_config, placement, engine_gpus, backend):
    """Inside our actor (in a placement group) vLLM would pick its Ray executor, whose workers wait for GPUs
    that are already held; the multiprocessing one starts them on the GPUs the actor sees."""
    gpus = [f"rollout.gpus_per_engine={engine_gpus}"] if placement == "disaggregated" else ["layout.world_size=2"]
    config = gpu_run_config("vllm", placement, f"rollout.tensor_parallel_size={engine_gpus}", *gpus)
    engine_class, arguments = _engine(config)
    assert arguments.get("distributed_executor_backend") == backend
    with one_thread():
        engine_class(config.model.path, **arguments)  # the fake checks the argument against vLLM's EngineArgs


def test_the_sharded_rdt_transport_builds_vllm_engines_for_it(gpu_run_config):
    """sync.transport=sharded_rdt (tests/gpu/test_trainer_gpu.py's sharded run): the engines are built with vLLM's
    sharded_rdt backend, which the fake's WeightTransferConfig accepts; only vLLM has it."""
    from gpu.test_trainer_gpu import SHARDED_RDT

    from rlmega.config import ConfigError

    config = gpu_run_config("vllm", "colocated", *SHARDED_RDT)
    engine_class, arguments = _engine(config)
    assert arguments["weight_transfer"] == "sharded_rdt"
    with one_thread():
        engine = engine_class(config.model.path, **arguments)
    assert engine.llm.calls[0][2]["weight_transfer_config"] == {"backend": "sharded_rdt"}
    with pytest.raises(ConfigError, match="sharded_rdt is vLLM's own weight transfer, but rollout.backend is 'sglang'"):
        gpu_run_config("sglang", "colocated", *SHARDED_RDT)

"""The minimal GPU tier: one CUDA GPU, no Ray / vLLM / SGLang / transformer-engine (tests/gpu/run_gpu_checks.sh
--tier minimal). Each ``*_on_gpu`` test runs a body of tests/gpu/minimal_checks.py on CUDA in bf16; the
``*_contract_on_cpu`` test beside it runs the same body on CPU in fp32, so the path is exercised on
every machine. The worker's log-probs against transformers on CUDA are in test_worker_gpu.py.

Tolerances (bf16 has an 8-bit mantissa, ~0.4% per rounding; a wrong mapping or a missed update is off
by whole nats, or leaves the weights unmoved):
- an update in bf16 on CUDA against the same update in fp32 on CPU: the weight changes point the same
  way (cosine >= UPDATE_COSINE_MIN) and the gradient norms agree within GRAD_NORM_RTOL;
- the post-sync check between the bf16 trainer and the bf16 engine: SYNC_ATOL_BF16 nats.
"""

import pytest
import torch

from rlmega.parallel.spawn import run_on_ranks

from .conftest import ENGINE_MODELS
from .measures import measured
from .minimal_checks import (distributed_optimizer_body, export_body, hf_engine_check, offload_body,
                             offloaded_optimizer_body, sync_body, update_body)

TIMEOUT_S = 240
UPDATE_COSINE_MIN = 0.9
GRAD_NORM_RTOL = 0.1
SYNC_ATOL_BF16 = 0.25
SYNC_ATOL_FP32 = 1e-3


def _on_rank(body, *args):
    return run_on_ranks(body, 1, timeout_s=TIMEOUT_S, args=args)[0]


def _flat(delta: dict) -> torch.Tensor:
    return torch.cat([delta[name].flatten() for name in sorted(delta)])


def _check_update(got: dict, reference: dict) -> None:
    assert got["delta"].keys() == reference["delta"].keys()
    moved, expected = _flat(got["delta"]), _flat(reference["delta"])
    assert expected.abs().max() > 0, "the reference update moved no weight"
    cosine = torch.nn.functional.cosine_similarity(moved, expected, dim=0).item()
    measured(cosine=cosine, grad_norm_ratio=got["grad_norm"] / reference["grad_norm"])
    assert cosine >= UPDATE_COSINE_MIN, cosine
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=GRAD_NORM_RTOL)


@pytest.fixture
def cpu_only_children(monkeypatch):
    """Spawned ranks see no GPU: the fp32 CPU reference on a GPU machine (spawned children inherit the env)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# ---- an update: bf16 on CUDA against fp32 on CPU -------------------------------------------------

@pytest.mark.gpu
def test_bf16_update_on_gpu_follows_the_fp32_cpu_update(gpu_llama_dir, monkeypatch):
    got = _on_rank(update_body, gpu_llama_dir, "bf16")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reference = _on_rank(update_body, gpu_llama_dir, "fp32")
    _check_update(got, reference)


def test_update_contract_on_cpu(gpu_llama_dir, cpu_only_children):
    reference = _on_rank(update_body, gpu_llama_dir, "fp32")
    _check_update(reference, reference)


# ---- offload -> onload ---------------------------------------------------------------------------

def _check_offload(result: dict, on_gpu: bool) -> None:
    measured(moved_mib=result["moved_out"] / 2**20, freed_mib=result["freed"] / 2**20)
    assert result["moved_out"] == result["moved_in"] > 0
    assert result["released"] and result["identical"] and result["on_device"] and result["trains"], result
    if on_gpu:  # the bytes offloaded left the device (the caching allocator's counter)
        assert result["freed"] >= 0.9 * result["moved_out"], result


@pytest.mark.gpu
def test_offload_onload_is_bit_exact_on_gpu(gpu_llama_dir):
    _check_offload(_on_rank(offload_body, gpu_llama_dir, "bf16"), on_gpu=True)


def test_offload_contract_on_cpu(gpu_llama_dir, cpu_only_children):
    _check_offload(_on_rank(offload_body, gpu_llama_dir, "fp32"), on_gpu=False)


# ---- the CPU-offloaded optimizer leaves the GPU, also once resumed --------------------------------

@pytest.mark.gpu
def test_the_offloaded_optimizer_keeps_none_of_its_state_on_the_gpu_built_stepped_or_resumed(gpu_llama_dir, tmp_path):
    found = _on_rank(offloaded_optimizer_body, gpu_llama_dir, str(tmp_path / "checkpoints"))
    measured(host_mib=found["stepped"]["host"] / 2**20, gpu_bytes=found["stepped"]["gpu"])
    # fp32 masters, Adam's two moments and the fp32 gradient copy: 16 bytes per owned element, all in host
    # memory (megatron-core 0.16 without the precision-aware optimizer kept a second fp32 master on the GPU).
    assert found["built"] == {"gpu": 0, "host": 4 * found["owned"]}
    assert found["stepped"] == found["resumed"] == {"gpu": 0, "host": 16 * found["owned"]}
    assert found["same_weights"]


def test_offloaded_optimizer_contract_on_cpu(gpu_llama_dir, tmp_path, cpu_only_children):
    # The same body under simulated_gpu: built and stepped as on the GPU; the checkpoint resumes to the same
    # weights (where the resumed state lives is the GPU check's alone).
    found = _on_rank(offloaded_optimizer_body, gpu_llama_dir, str(tmp_path / "checkpoints"))
    assert found["built"] == {"gpu": 0, "host": 4 * found["owned"]} and found["owned"] > 0
    assert found["stepped"] == {"gpu": 0, "host": 16 * found["owned"]}
    assert found["resumed"] is None and found["same_weights"]


# ---- the distributed optimizer at world size 1 over NCCL ----------------------------------------

@pytest.mark.gpu
def test_distributed_optimizer_over_nccl_equals_the_plain_one(gpu_llama_dir):
    (sharded_classes, sharded), (plain_classes, plain) = _on_rank(distributed_optimizer_body, gpu_llama_dir,
                                                                  (True, False))
    assert all(name == "DistributedOptimizer" for name in sharded_classes), sharded_classes
    assert not any(name == "DistributedOptimizer" for name in plain_classes), plain_classes
    measured(max_abs_diff=max((sharded[name] - tensor).abs().max().item() for name, tensor in plain.items()))
    for name, tensor in plain.items():
        torch.testing.assert_close(sharded[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_distributed_optimizer_contract_on_cpu(gpu_llama_dir, cpu_only_children):
    # gloo has no reduce-scatter: the default (None) resolves to the plain optimizer, the same update.
    (default_classes, default), (plain_classes, plain) = _on_rank(distributed_optimizer_body, gpu_llama_dir,
                                                                  (None, False))
    assert "DistributedOptimizer" not in default_classes + plain_classes
    for name, tensor in plain.items():
        torch.testing.assert_close(default[name], tensor, atol=0, rtol=0, msg=name)


# ---- the bridge's export -------------------------------------------------------------------------

def _check_export(result: dict, device: str, dtype: torch.dtype) -> None:
    measured(tensors=len(result["names"]), differing=len(result["differing"]))
    assert result["device"] == device
    assert result["names"] == result["checkpoint_names"]
    assert result["devices"] == {device} and result["dtypes"] == {dtype}, result
    assert result["differing"] == []


@pytest.mark.gpu
def test_bridge_exports_cuda_bf16_tensors(gpu_llama_dir):
    _check_export(_on_rank(export_body, gpu_llama_dir, "bf16"), "cuda", torch.bfloat16)


def test_export_contract_on_cpu(gpu_llama_dir, cpu_only_children):
    _check_export(_on_rank(export_body, gpu_llama_dir, "fp32"), "cpu", torch.float32)


# ---- the hf engine -------------------------------------------------------------------------------

def _check_hf_engine(result: dict, atol: float) -> None:
    measured(rescored_max=result["rescored_max"], freed_mib=result["freed"] / 2**20)
    assert result["rescored_max"] <= atol, result  # batched, left-padded decoding against one sequence
    assert result["version"] == 1 and result["changed"] and result["updated_equals_fresh"], result
    assert result["same_after_wake"], result


@pytest.mark.gpu
def test_hf_engine_on_gpu_in_bf16(gpu_llama_dir, gpu_llama_other_dir):
    result = hf_engine_check(gpu_llama_dir, gpu_llama_other_dir, "cuda", torch.bfloat16)
    assert result["device"] == "cuda" and result["freed"] > 0, result
    _check_hf_engine(result, atol=0.1)


def test_hf_engine_contract_on_cpu(gpu_llama_dir, gpu_llama_other_dir):
    result = hf_engine_check(gpu_llama_dir, gpu_llama_other_dir, "cpu", torch.float32)
    _check_hf_engine(result, atol=1e-4)


# ---- an in-process sync and the post-sync check --------------------------------------------------

def _check_sync(result: dict, kind: str) -> None:
    measured(**{f"{kind}_worst": result["worst"], f"{kind}_mib": result["bytes"] / 2**20})
    assert result["caught_unsynced"], "the post-sync check passed an engine serving other weights"
    assert result["transport"] == "in_process" and result["bytes"] > 0 and result["version"] == 1, result
    assert result["synced_on_device"], result


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ENGINE_MODELS)
def test_in_process_sync_and_post_sync_check_in_bf16(gpu_model_dirs, kind):
    result = _on_rank(sync_body, gpu_model_dirs(kind), gpu_model_dirs(kind, 1), "bf16", SYNC_ATOL_BF16)
    _check_sync(result, kind)
    assert result["worst"] <= SYNC_ATOL_BF16


@pytest.mark.parametrize("kind", ENGINE_MODELS)
def test_sync_contract_on_cpu(gpu_model_dirs, kind, cpu_only_children):
    result = _on_rank(sync_body, gpu_model_dirs(kind), gpu_model_dirs(kind, 1), "fp32", SYNC_ATOL_FP32)
    _check_sync(result, kind)
    assert result["worst"] <= SYNC_ATOL_FP32

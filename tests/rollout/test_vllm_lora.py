"""VLLMEngine serving LoRA adapters (``lora_rank``, ``sync.lora=adapters``) against the fake vllm 0.33, whose LoRA calls
are bound to the wheel's (fakes/api/vllm.json) and which applies the PEFT adapter it loads: an update of adapter
tensors equals, in what the engine generates, an update of the merged weights."""

import json
import sys

import pytest
import torch

from rlmega.rollout.lora_serving import ADAPTER_CONFIG

from .fakes import api_snapshot, fake_vllm, one_thread
from . import peft_updates as peft
from .tiny_models import checkpoint_tensors


@pytest.fixture
def make_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", fake_vllm.lora_request_module)
    from rlmega.rollout.vllm_engine import VLLMEngine

    with one_thread():
        yield lambda path, **kwargs: VLLMEngine(path, gpu_memory_utilization=0.5, **kwargs)


def test_vllm_is_built_for_one_adapter_of_a_rank_it_has_kernels_for(make_engine, llama_dir):
    from rlmega.rollout.vllm_engine import MAX_LORA_RANKS

    for release in ("vllm", "vllm-0.34"):  # both supported wheels allow these ranks
        assert list(MAX_LORA_RANKS) == api_snapshot.load(release)["constants"]["MaxLoRARanks"]
    engine = make_engine(llama_dir, lora_rank=peft.RANK)
    _, _, kwargs = engine.llm.calls[0]
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)
    assert "enable_lora" not in make_engine(llama_dir).llm.calls[0][2]  # merged syncs: no LoRA kernels
    with pytest.raises(ValueError, match="a LoRA rank of 600 cannot be served by vLLM.*between 1 and 512"):
        make_engine(llama_dir, lora_rank=600)
    with pytest.raises(ValueError, match="lora_rank=4 .* weight_dtype='fp8' must be 'nccl' and 'auto'"):
        make_engine(llama_dir, lora_rank=peft.RANK, weight_dtype="fp8")


def test_an_adapter_update_generates_as_the_merged_weights_do(make_engine, llama_dir, tmp_path):
    base = checkpoint_tensors(llama_dir)
    engine = make_engine(llama_dir, lora_rank=peft.RANK, lora_dir=str(tmp_path / "adapters"))
    merged_engine = make_engine(llama_dir)
    before = peft.greedy(engine)
    for version, seed in ((1, 0), (2, 1)):
        adapter = peft.adapter(llama_dir, seed)
        engine.update_weights(peft.stream(adapter), version)
        merged_engine.update_weights(list(peft.merged(base, adapter).items()), version)
        served = peft.greedy(engine)
        peft.assert_same(served, peft.greedy(merged_engine))
        assert engine.weight_version() == version
    assert served != before  # the adapter changes what the engine generates
    # Adapters alone: vLLM's weight-update session never opened, the base never moved.
    assert not [call for call in engine.llm.calls if call[0] in ("start_weight_update", "collective_rpc")]
    # Each version loaded from its own directory; the one before removed from vLLM and from disk.
    assert engine.llm.llm_engine.list_loras() == {2}
    first, second = engine.llm.llm_engine.loads
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == [second.rsplit("/", 1)[-1]]
    written = tmp_path / "adapters" / second.rsplit("/", 1)[-1] / ADAPTER_CONFIG
    assert json.loads(written.read_text())["r"] == peft.RANK
    requests = engine.llm.llm_engine.requests  # every request names the adapter of its version (none before)
    assert requests[0] is None and requests[-1].lora_int_id == 2 and requests[-1].lora_path == second


def test_base_weights_and_adapter_in_one_update(make_engine, llama_dir, llama_other_dir):
    peft.check_base_weights_and_adapter_in_one_update(make_engine, llama_dir, llama_other_dir)


def test_an_update_without_its_adapter_config_is_refused_and_left_torn(make_engine, llama_dir):
    peft.check_an_adapter_without_its_config_is_refused_and_left_torn(make_engine, llama_dir)


def test_vllm_refuses_an_adapter_above_its_max_rank(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)  # max_lora_rank 8
    generator = torch.Generator().manual_seed(0)
    adapter = {name: torch.randn(16, t.shape[1], generator=generator) if ".lora_A." in name else
               torch.randn(t.shape[0], 16, generator=generator) for name, t in peft.adapter(llama_dir, 0).items()}
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        engine.update_weights(peft.stream(adapter, {**peft.config(), "r": 16}), 1)
    assert not engine.health()["ready"]


def test_the_adapter_of_a_failed_update_never_loads(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)

    def failing():
        yield from peft.stream(peft.adapter(llama_dir, 0))
        raise RuntimeError("the sender failed")

    with pytest.raises(RuntimeError, match="the sender failed"):
        engine.update_weights(failing(), 1)
    engine.update_weights(list(checkpoint_tensors(llama_dir).items()), 2)  # base weights alone
    assert engine.llm.llm_engine.list_loras() == set() and engine.health()["ready"]

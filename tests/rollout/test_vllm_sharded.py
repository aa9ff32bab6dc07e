"""``ShardedSync`` (rlmega.sync.vllm_sharded): vLLM 0.33's ``sharded_rdt`` transfer driven from real Megatron
ranks into ``VLLMEngine``s, against fakes bound to the wheel's API: fakes/fake_vllm_weight_transfer.py keeps the
trainer side's rules (group-contiguous metadata, the default group's rank, owned names in metadata order, the
client called by the sender only, in order) with one producer folder per rank, and fakes/fake_vllm.py the
engine's init / start / update / finish, whose update pulls every tensor from an owner's producer.

On two ranks (TP2, two engines; PP2, one engine, through the training ranks' ``sync.transport=sharded_rdt``
glue), two syncs: after the first each engine holds the trainer's
checkpoint bit for bit, after the second the trained (shifted) weights, and serves version 2.
"""

import os
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlmega.bridge import load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.sync import SyncConfig, sharded_rdt_needs
from rlmega.sync.errors import TransportError

from .fakes import fake_vllm_weight_transfer, one_thread

TIMEOUT_S = 240
TRANSFER_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")



def _the_fake_stands_in_for_nixl() -> None:
    """The fake weight transfer moves the tensors itself: what sharded_rdt needs beyond vLLM (Ray's direct
    transport over nixl, ``rlmega.sync.sharded_rdt_needs``) is not needed here (its own test is
    tests/sync/test_sharded_rdt_needs.py)."""
    sharded_rdt_needs.require = lambda: None

def _engine_state(engine) -> dict:
    return {name: tensor.clone() for name, tensor in engine.llm.worker.model_runner.model.model.state_dict().items()}


def _sync_on_rank(rank, world_size, layout, hf_dir, other_dir, folder, replicas, through_trainer):
    os.environ["RLMEGA_FAKE_RDT_DIR"] = folder
    sys.modules.update(fake_vllm_weight_transfer.modules())
    _the_fake_stands_in_for_nixl()
    from rlmega.models.lora import LoraConfig
    from rlmega.rollout.vllm_engine import VLLMEngine
    from rlmega.sync.vllm_sharded import ShardedSync
    from rlmega.trainer.training_group import RankProcess

    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    engines = None
    if rank == 0:
        with one_thread():
            engines = [VLLMEngine(other_dir, weight_transfer="sharded_rdt", gpu_memory_utilization=0.5)
                       for _ in range(replicas)]
    if through_trainer:  # the training ranks' glue (sync.transport=sharded_rdt) on a bare rank process
        process = RankProcess.__new__(RankProcess)
        process.rank, process.spec, process.weight_sync, process.sliced_setup = rank, spec, None, None
        process.engine_weight_dtype = "auto"
        process.sync_config, process.post_sync_atol = SyncConfig(transport="sharded_rdt", timeout_s=120), 1e-3
        actor = types.SimpleNamespace(chunks=chunks, config=types.SimpleNamespace(lora=LoraConfig()))  # no LoRA
        process.workers = {"actor": actor}
        process.connect_engines(engines)  # the transport is chosen here, once
        push = process.push_weights  # rank 0's stats, None elsewhere
    else:
        sync = ShardedSync(chunks, spec, engines, timeout_s=120)
        push = sync.push
    result = {"first": push(1)}
    if engines:
        result["after_first"] = [_engine_state(engine) for engine in engines]
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.add_(0.5)
    result["second"] = push(2)
    sync = process.weight_sync.transport if through_trainer else sync  # made once, kept for the second push
    result["served"] = sync.bytes
    if engines:
        result["after_second"] = [_engine_state(engine) for engine in engines]
        result["versions"] = [engine.weight_version() for engine in engines]
        result["calls"] = [[call for call in engine.llm.calls if call[0] in TRANSFER_CALLS] for engine in engines]
    sync.close()
    destroy()
    return result


@pytest.mark.parametrize("layout_name, replicas, through_trainer", [("tp2", 2, False), ("pp2", 1, True)])
def test_two_syncs_bring_the_trained_weights_into_every_engine(layout_name, replicas, through_trainer, llama_dir,
                                                               llama_other_dir, tmp_path):
    layout = ParallelLayout(tp=2, world_size=2) if layout_name == "tp2" else ParallelLayout(pp=2, world_size=2)
    results = run_on_ranks(_sync_on_rank, 2, timeout_s=TIMEOUT_S, args=(
        layout, str(llama_dir), str(llama_other_dir), str(tmp_path), replicas, through_trainer))
    saved = load_file(Path(llama_dir) / "model.safetensors")
    head = results[0]
    for state in head["after_first"]:
        assert sorted(state) == sorted(saved)
        assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
    for state in head["after_second"]:
        assert all(torch.equal(state[name], tensor + 0.5) for name, tensor in saved.items())
    assert head["versions"] == [2] * replicas

    model_bytes = sum(tensor.nbytes for tensor in saved.values())
    served = [result["served"] for result in results]
    if layout_name == "tp2":  # both ranks own (and serve) every tensor
        assert served == [model_bytes] * 2
    else:  # each stage its own, together the model once
        assert sum(served) == model_bytes and all(served)
    assert head["second"].transport == "sharded_rdt" and head["second"].version == 2
    assert head["second"].bytes == served[0]
    if not through_trainer:
        assert results[1]["second"].transport is None and results[1]["second"].bytes == served[1]

    for index, calls in enumerate(head["calls"]):
        names = [call[0] for call in calls]
        assert names == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights",
                                                           "finish_weight_update"] * 2
        init = calls[0][1]
        assert (init["replica_rank"], init["num_replicas"], init["num_consumers"]) == (index, replicas, replicas)
        assert sorted(init["names"]) == sorted(saved) and sum(init["group_lens"]) == len(saved)
        assert init["owner_sets"] == ([[0, 1]] if layout_name == "tp2" else [[0], [1]])
        assert [call[1] for call in calls if call[0] == "finish_weight_update"] == ["1", "2"]


@pytest.fixture
def vllm(monkeypatch):
    for name, module in fake_vllm_weight_transfer.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sharded_rdt_needs, "require", lambda: None)  # as _the_fake_stands_in_for_nixl
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        yield


def test_an_engine_takes_its_weights_one_way_only(vllm, llama_dir, llama_other_dir):
    from rlmega.rollout.vllm_engine import VLLMEngine

    sharded = VLLMEngine(llama_dir, weight_transfer="sharded_rdt", gpu_memory_utilization=0.5)
    assert sharded.llm.calls[0][2]["weight_transfer_config"] == {"backend": "sharded_rdt"}
    tensors = list(load_file(Path(llama_other_dir) / "model.safetensors").items())
    with pytest.raises(RuntimeError, match="built with weight_transfer='sharded_rdt'.*ShardedSync"):
        sharded.update_weights(iter(tensors), version=1)
    assert sharded.weight_version() == 0 and sharded.health()["ready"]

    plain = VLLMEngine(llama_dir, gpu_memory_utilization=0.5)
    with pytest.raises(RuntimeError, match="weight_transfer='sharded_rdt'"):
        plain.native_transfer_init({})
    with pytest.raises(ValueError, match=r"weight_transfer='ipc': choose one of \['nccl', 'sharded_rdt'\]"):
        VLLMEngine(llama_dir, weight_transfer="ipc")


class _Engine:
    def __init__(self, workers, fail=None):
        self.workers, self.fail, self.inits = workers, fail, []

    def native_transfer_workers(self):
        return self.workers

    def native_transfer_init(self, init_info):
        if self.fail:
            raise RuntimeError(self.fail)
        self.inits.append(init_info)


def test_the_client_fans_out_and_names_a_failing_engine():
    from rlmega.sync.vllm_sharded import EnginesClient

    engines = [_Engine(2), _Engine(2)]
    client = EnginesClient(engines, timeout_s=60)
    assert client.workers() == 2
    client.init_weight_transfer_engine({"names": ["w"]})
    assert [engine.inits for engine in engines] == [[{"names": ["w"], "replica_rank": i, "num_replicas": 2}]
                                                    for i in range(2)]
    with pytest.raises(ValueError, match=r"same number of workers, got \[2, 4\]"):
        EnginesClient([_Engine(2), _Engine(4)], timeout_s=60).workers()
    with pytest.raises(TransportError, match="rollout engine 1 failed in native_transfer_init: NIXL is missing"):
        EnginesClient([_Engine(2), _Engine(2, fail="NIXL is missing")], timeout_s=60).init_weight_transfer_engine({})
    with pytest.raises(RuntimeError, match="version is not set"):
        client.start_weight_update()


def test_the_engines_belong_on_the_sender_only(vllm):
    from rlmega.sync.vllm_sharded import ShardedSync

    with pytest.raises(ValueError, match="engines on trainer rank 0 .*rank 0 got None"):
        ShardedSync([], None, None)

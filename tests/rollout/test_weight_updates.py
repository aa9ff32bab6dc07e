"""The weight-update steps every engine shares (``rlmega.rollout.weight_updates``): what each step records, and
that HFEngine and the adapters take them alike."""

import sys

import pytest
import torch

from rlmega.rollout import EngineNotReadyError, HFEngine, UnknownWeightError
from rlmega.rollout.weight_updates import WeightBook, WeightUpdates

from .fakes import fake_sglang, fake_vllm, one_thread

NAMES = ("a", "b", "c")


class RecordingEngine:
    """An engine side that writes buckets of one tensor each and records every call in order."""

    def __init__(self):
        self.book = WeightBook(NAMES)
        self.calls = []
        self.updates = WeightUpdates(self.book, checked_buckets=self.checked_buckets, load=self.load,
                                     committed=self.committed)

    def checked_buckets(self, named_tensors):
        for name, tensor in named_tensors:
            self.calls.append(("check", name))
            if name not in NAMES:
                raise UnknownWeightError(f"unknown weight name {name!r}")
            yield name, {name}

    def load(self, bucket):
        self.calls.append(("load", bucket, self.book.torn_version))

    def committed(self, version):
        self.calls.append(("committed", version))


def test_each_bucket_is_checked_before_it_is_written_and_the_version_commits_after_the_last():
    engine = RecordingEngine()
    engine.book.slept(2)  # every name must come again
    engine.updates.begin(3)
    engine.updates.write([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    assert engine.book.version == 0 and engine.book.missing == {"c"}
    engine.updates.commit()
    assert engine.calls == [("check", "a"), ("load", "a", 3), ("check", "b"), ("load", "b", 3), ("committed", 3)]
    assert engine.book.version == 3 and engine.book.torn_version is None and engine.book.pending is None


def test_a_bad_tensor_after_a_written_one_leaves_the_update_torn():
    engine = RecordingEngine()
    engine.updates.begin(1)
    with pytest.raises(UnknownWeightError, match="'x'"):
        engine.updates.write([("a", torch.zeros(1)), ("x", torch.zeros(1)), ("b", torch.zeros(1))])
    assert engine.calls == [("check", "a"), ("load", "a", 1), ("check", "x")]
    assert engine.book.torn_version == 1 and engine.book.version == 0
    with pytest.raises(EngineNotReadyError, match="update to weight version 1 failed part way"):
        engine.book.check_ready()


def test_steps_outside_an_update_are_refused():
    engine = RecordingEngine()
    with pytest.raises(RuntimeError, match=r"write_weights called outside an update; call begin_update\(version\)"):
        engine.updates.write([("x", torch.zeros(1))])  # refused before any tensor is looked at
    with pytest.raises(RuntimeError, match=r"commit_update called outside an update"):
        engine.updates.commit()
    assert engine.calls == []


@pytest.fixture(params=["hf", "vllm", "sglang"])
def engine(request, monkeypatch, llama_dir):
    if request.param == "hf":
        yield HFEngine(llama_dir, attn_implementation="eager")
        return
    with one_thread():
        if request.param == "vllm":
            from rlmega.rollout.vllm_engine import VLLMEngine

            monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
            monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
            yield VLLMEngine(llama_dir, gpu_memory_utilization=0.5)
        else:
            from rlmega.rollout.sglang_engine import SGLangEngine

            monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
            monkeypatch.delenv(fake_sglang.RAW_LOGPROB_ENV, raising=False)
            sglang = SGLangEngine(llama_dir, mem_fraction_static=0.5)
            yield sglang
            sglang.shutdown()


def test_every_engine_refuses_writes_outside_an_update_alike(engine):
    for stream in ([], [("model.norm.weight", torch.zeros(64))], [("model.nrm.weight", torch.zeros(64))]):
        with pytest.raises(RuntimeError, match=r"^write_weights called outside an update; call begin_update"):
            engine.write_weights(stream)
    with pytest.raises(RuntimeError, match=r"^commit_update called outside an update"):
        engine.commit_update()
    assert engine.weight_version() == 0 and engine.health()["ready"]
    engine.begin_update(2)
    engine.write_weights([("model.norm.weight", torch.ones(64))])
    assert engine.weight_version() == 0 and engine.health()["torn_update_version"] == 2
    engine.commit_update()
    assert engine.weight_version() == 2 and engine.health()["ready"]

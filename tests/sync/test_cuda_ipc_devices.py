"""CPU contract of the CUDA IPC region handle (tests/sync/test_gpu.py moves real CUDA buckets): the
receiver opens the sender's GPU under its own index for that GPU, found by UUID, because a Ray engine
actor on the same host sees other CUDA_VISIBLE_DEVICES than the trainer rank."""

import types

import pytest
import torch

from rlmega.sync import shared_memory
from rlmega.sync.shared_memory import IPC_DEVICE_ARG, RegionHandle


def _receiver_sees(monkeypatch, uuids):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


def _handle(sender_index: int, uuid: str, opened: list) -> RegionHandle:
    args = [None] * 15  # rebuild_cuda_tensor's arguments, as reduce_tensor returns them
    args[IPC_DEVICE_ARG] = sender_index
    return RegionHandle(1, 64, cuda_ipc=(lambda *a: opened.append(a[IPC_DEVICE_ARG]), tuple(args)),
                        device_uuid=uuid)


def test_the_region_opens_on_the_receivers_index_of_the_senders_gpu(monkeypatch):
    # The trainer rank sees GPU-c as cuda:0 (CUDA_VISIBLE_DEVICES=2); the engine actor sees GPU-a..GPU-d.
    _receiver_sees(monkeypatch, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    opened = []
    _handle(sender_index=0, uuid="GPU-c", opened=opened).open()
    assert opened == [2]


def test_a_gpu_the_receiver_cannot_see_is_refused_by_name(monkeypatch):
    _receiver_sees(monkeypatch, ["GPU-a"])
    with pytest.raises(RuntimeError, match="the sender's GPU GPU-c is not visible in this process"):
        _handle(sender_index=0, uuid="GPU-c", opened=[]).open()


def test_the_sender_names_its_gpu_by_uuid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=f"GPU-{i}"))
    assert shared_memory.device_uuid(3) == "GPU-3"

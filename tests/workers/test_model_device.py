"""Where a built model lives. Megatron allocates its parallel layers on the current GPU but builds the modules
it takes from torch (the norms, without transformer-engine or apex) on the CPU; a worker on a GPU must move
the whole chunk there, or its first norm meets a CUDA input with a CPU weight. No GPU here: the move is
checked through the call it makes."""

import types

import torch

from rlmega.models.spec import on_training_device


def test_a_model_built_for_the_gpu_moves_there_whole(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4))
    moved_to = []

    def cuda(module, device=None):
        moved_to.append((module, device))
        return module

    monkeypatch.setattr(torch.nn.Module, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert on_training_device(model, types.SimpleNamespace(use_cpu_initialization=False)) is model
    assert moved_to == [(model, 3)]  # the whole model, to the device Megatron allocated on


def test_a_model_initialised_on_the_cpu_stays_there(monkeypatch):
    model = torch.nn.RMSNorm(4)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError))
    assert on_training_device(model, types.SimpleNamespace(use_cpu_initialization=True)) is model
    assert model.weight.device.type == "cpu"

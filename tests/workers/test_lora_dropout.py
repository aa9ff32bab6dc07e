"""LoRA dropout (``actor.lora.dropout``, PEFT's ``lora_dropout``) acts in training passes only: log-prob passes are
deterministic and equal those without dropout, the merged weights ignore it, and a training pass drops elements of
the adapters' input (so the update's gradient differs), for column- and row-parallel layers alike."""

import dataclasses

import torch

from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.lora_export import peft_config
from rlmega.workers.worker import MegatronWorker
from test_lora import _set_random_b
from test_lora_update import _lora_config
from test_worker_update import _training_batch
from worker_cases import make_batch

DROPOUT = 0.5


def _passes(layout, hf_dir, dropout):
    config = _lora_config()
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, dropout=dropout))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    _set_random_b(worker, hf_dir)
    batch = make_batch()
    logprobs = [worker.compute_logprobs(batch)[0] for _ in range(2)]
    merged = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    found = [adapter for _, adapter in lora.adapters(worker.chunks)]
    training = {}
    for name, row_parallel in (("column", False), ("row", True)):
        adapter = next(adapter for adapter in found if adapter.row_parallel == row_parallel)
        x = torch.randn(6, 2, adapter.lora_a.shape[1], generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            no_grad = adapter.delta(x)
        training[name] = (no_grad, adapter.delta(x), adapter.delta(x))
    metrics = worker.update(_training_batch(batch, logprobs[0]))
    return dict(logprobs=logprobs, merged=merged, training=training, grad_norm=metrics["actor/grad_norm"])


def _dropout_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    results = {dropout: _passes(layout, hf_dir, dropout) for dropout in (DROPOUT, 0.0)}
    destroy()
    return results


def test_dropout_acts_in_training_passes_only(checkpoints):
    layout = ParallelLayout(world_size=1)
    [results] = run_on_ranks(_dropout_body, 1, timeout_s=240, args=(layout, str(checkpoints["llama"])))
    dropped, plain = results[DROPOUT], results[0.0]
    for first, second, without in zip(*dropped["logprobs"], plain["logprobs"][0]):
        assert torch.equal(first, second) and torch.equal(first, without)
    for name, tensor in plain["merged"].items():
        assert torch.equal(dropped["merged"][name], tensor), name
    for name in ("column", "row"):
        no_grad, training, again = dropped["training"][name]
        assert not torch.allclose(training, no_grad, atol=1e-3) and not torch.allclose(training, again, atol=1e-3)
        assert all(torch.equal(tensor, plain["training"][name][0]) for tensor in plain["training"][name])
    assert dropped["grad_norm"] != plain["grad_norm"]


def test_peft_config_carries_the_dropout():
    config = peft_config(lora.LoraConfig(rank=4, dropout=0.1), {"base_model.model.q_proj.lora_A.weight": None}, "m")
    assert config["lora_dropout"] == 0.1

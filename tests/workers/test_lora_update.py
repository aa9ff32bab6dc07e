"""Training LoRA adapters: the optimizer holds the adapters alone, the base weights never change, and two updates give
the same merged weights in every layout (TP2, TP2 with sequence parallelism, PP2, DP2) as on one rank."""

import dataclasses

import pytest
import torch

from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.worker import MegatronWorker
from test_worker_update import _config, _training_batch
from worker_cases import make_batch

ATOL = 1e-5
TIMEOUT_S = 300


def _lora_config(sequence_parallel=None):
    return dataclasses.replace(_config(), lora=lora.LoraConfig(rank=4, alpha=8.0), sequence_parallel=sequence_parallel)


def _update_body(rank, world_size, layout, hf_dir, config):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    adapter_elements = sum(p.numel() for _, a in lora.adapters(worker.chunks) for p in (a.lora_a, a.lora_b))
    optimized = [p for group in worker.optimizer.param_groups for p in group["params"]]
    metrics = []
    for _ in range(2):  # the second step also moves A (its gradient is zero while B is)
        batch = make_batch()
        old_logp, _ = worker.compute_logprobs(batch)
        metrics.append(worker.update(_training_batch(batch, old_logp)))
    merged = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    with lora.adapters_disabled(worker.chunks):
        base = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return dict(adapter_elements=adapter_elements, optimized_elements=sum(p.numel() for p in optimized),
                adapters_only=all(getattr(p, "is_lora_adapter", False) for p in optimized),
                metrics=metrics, merged=merged, base=base)


def _run(checkpoints, layout_args, config):
    layout = ParallelLayout(**layout_args)
    return run_on_ranks(_update_body, layout.world_size, timeout_s=TIMEOUT_S,
                        args=(layout, str(checkpoints["llama"]), config))[0]


@pytest.fixture(scope="module")
def reference(checkpoints):
    return _run(checkpoints, dict(world_size=1), _lora_config())


def test_only_adapters_train(checkpoints, reference):
    from safetensors.torch import load_file

    original = load_file(checkpoints["llama"] / "model.safetensors")
    assert reference["adapters_only"] and reference["optimized_elements"] == reference["adapter_elements"] > 0
    assert all(step["actor/grad_norm"] > 0 for step in reference["metrics"])
    for name, tensor in reference["base"].items():  # frozen: bit for bit the checkpoint's
        assert torch.equal(tensor, original[name]), name
    changed = [name for name, tensor in reference["merged"].items() if not torch.equal(tensor, original[name])]
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed and all(name.split(".")[-2] in adapted for name in changed)
    assert len(changed) == 4 * len(adapted)


CASES = {
    "tp2": (dict(tp=2, world_size=2), None),
    "tp2-sp": (dict(tp=2, world_size=2), True),
    "pp2": (dict(pp=2, world_size=2), None),
    "dp2": (dict(world_size=2), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_update_is_the_same_in_every_layout(checkpoints, reference, case):
    layout_args, sequence_parallel = CASES[case]
    result = _run(checkpoints, layout_args, _lora_config(sequence_parallel))
    for step, want in zip(result["metrics"], reference["metrics"]):
        assert step["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    for name, tensor in reference["merged"].items():
        torch.testing.assert_close(result["merged"][name], tensor, rtol=0, atol=ATOL, msg=name)

"""Memory knobs of the worker: activation recomputation (full, block, selective) changes nothing
but memory (the same update as without, fp32, at TP1 and TP2xPP2); a frozen MoE router stays put
while the rest trains; activation offload is refused on CPU with the reason."""

import dataclasses

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import WorkerConfig
from rlmega.workers.worker import MegatronWorker
from test_worker_update import _config, _training_batch
from worker_cases import make_batch

RECOMPUTE = {
    "none": {},
    "full-uniform": dict(recompute_granularity="full"),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}


def _updates_body(rank, world_size, layout, hf_dir, settings):
    initialize(layout)
    batch = make_batch()
    results = {}
    for name, memory in settings.items():
        worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, dataclasses.replace(_config(), **memory),
                                hf_dir=hf_dir)
        old_logp, _ = worker.compute_logprobs(batch)
        metrics = worker.update(_training_batch(batch, old_logp))
        results[name] = (metrics["actor/grad_norm"], {n: t.clone() for n, t in worker.export_hf_weights(destinations=[0])})
    destroy()
    return results


@pytest.mark.parametrize("layout_args", [dict(world_size=1), dict(tp=2, pp=2, world_size=4)], ids=["tp1", "tp2-pp2"])
def test_recomputation_gives_the_same_update(checkpoints, layout_args):
    layout = ParallelLayout(**layout_args)
    results = run_on_ranks(_updates_body, layout.world_size, timeout_s=300,
                           args=(layout, str(checkpoints["llama"]), RECOMPUTE))[0]
    reference_norm, reference = results["none"]
    assert reference_norm > 0
    for name in RECOMPUTE:
        grad_norm, weights = results[name]
        assert grad_norm == pytest.approx(reference_norm, rel=1e-6, abs=0), name
        for key, tensor in reference.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")


def _frozen_router_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, dataclasses.replace(_config(), freeze_moe_router=True),
                            hf_dir=hf_dir)
    before = {n: t.clone() for n, t in worker.export_hf_weights()}
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    worker.update(_training_batch(batch, old_logp))
    after = dict(worker.export_hf_weights())
    destroy()
    return {name: bool(torch.equal(before[name], after[name])) for name in before}


def test_frozen_moe_router_stays_while_the_rest_trains(checkpoints):
    unchanged = run_on_ranks(_frozen_router_body, 1, timeout_s=300,
                             args=(ParallelLayout(), str(checkpoints["qwen3-moe"])))[0]
    routers = [name for name in unchanged if name.endswith("mlp.gate.weight")]  # HF's name of the router
    assert routers and all(unchanged[name] for name in routers)
    others = [name for name in unchanged if name not in routers]
    assert not any(unchanged[name] for name in others if "layers" in name and "norm" not in name)


def _build_body(rank, world_size, hf_dir, config):
    initialize(ParallelLayout())
    try:
        MegatronWorker(model_spec_from_hf(hf_dir), ParallelLayout(), config, hf_dir=hf_dir)
    finally:
        destroy()


@pytest.mark.parametrize("config, message", [
    (WorkerConfig(activation_offload_layers=1), "needs CUDA; on CPU use recompute_granularity"),
    (WorkerConfig(freeze_moe_router=True), "freeze_moe_router needs a MoE model"),
    (WorkerConfig(recompute_granularity="selective", recompute_modules=["layernorm"]), "needs transformer-engine"),
])
def test_settings_that_cannot_work_here_are_refused(checkpoints, config, message):
    from rlmega.parallel.spawn import RankFailure

    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_build_body, 1, timeout_s=120, args=(str(checkpoints["llama"]), config))


@pytest.mark.parametrize("settings, message", [
    (dict(recompute_granularity="partial"), "must be full, selective or None"),
    (dict(recompute_method="block"), "need recompute_granularity=full"),
    (dict(recompute_modules=["mlp"]), "needs recompute_granularity=selective"),
    (dict(activation_offload_layers=2, recompute_granularity="full"), "exclude each other"),
])
def test_bad_memory_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**settings)

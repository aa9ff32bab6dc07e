"""A colocated weight sync keeps only the parameters on the device: ``release_training_state`` frees the gradient
buffers and moves the optimizer's state to host memory, the export still reads the trained weights, and the next
update brings both back, so training across it is bit for bit the training without it."""

import pytest
import torch

from hf_models import save_tiny_model
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import BatchingConfig, OptimizerConfig, WorkerConfig
from rlmega.workers.offload import gradient_tensors, optimizer_tensors, parameter_tensors
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

TIMEOUT_S = 300
STEPS = 3


def _device_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _train(rank, world_size, layout, hf_dir, dtype, distributed, release):
    initialize(layout)
    config = WorkerConfig(role="actor", dtype=dtype, batching=BatchingConfig(max_tokens_per_microbatch=24),
                          optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, distributed_optimizer=distributed))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir, total_steps=STEPS)
    generator = torch.Generator().manual_seed(7)
    seen = []
    for step in range(STEPS):
        batch = make_batch(step)
        old_logp, _ = worker.compute_logprobs(batch)
        worker.update(batch.with_fields(old_logp=old_logp,
                                        advantages=[torch.randn(n, generator=generator) for n in batch.response_lengths]))
        if release:
            before = {name: t.clone() for name, t in worker.export_hf_weights(destinations=[0])}
            parameters = _device_bytes(parameter_tensors(worker.chunks))
            freed = worker.release_training_state()
            exported = {name: t.clone() for name, t in worker.export_hf_weights(destinations=[0])}
            state = [t for t in optimizer_tensors(worker.optimizer)
                     if t.untyped_storage().data_ptr() not in {p.untyped_storage().data_ptr()
                                                                for p in parameter_tensors(worker.chunks)}]
            seen.append(dict(freed=freed, grads_left=_device_bytes(gradient_tensors(worker.chunks)),
                             state_left=_device_bytes(state), parameters_kept=parameters
                             == _device_bytes(parameter_tensors(worker.chunks)),
                             export_same=sorted(before) == sorted(exported)
                             and all(torch.equal(before[n], exported[n]) for n in before)))
    weights = {name: t.clone() for name, t in worker.export_hf_weights(destinations=[0])}
    worker.restore_training_state()  # released after the last step: its state is in host memory
    state = [t.clone() for t in optimizer_tensors(worker.optimizer)]
    destroy()
    return weights, state, seen


@pytest.mark.parametrize("world_size, dtype, distributed", [(1, "fp32", False), (2, "bf16", True)],
                         ids=["fp32-one-rank", "bf16-distributed-optimizer-dp2"])
def test_training_across_a_released_training_state_is_bit_exact(tmp_path, world_size, dtype, distributed):
    save_tiny_model("llama", tmp_path / "hf")
    args = (ParallelLayout(world_size=world_size), str(tmp_path / "hf"), dtype, distributed)
    kept = run_on_ranks(_train, world_size, timeout_s=TIMEOUT_S, args=args + (False,))
    released = run_on_ranks(_train, world_size, timeout_s=TIMEOUT_S, args=args + (True,))
    for (weights, state, _), (weights_r, state_r, seen) in zip(kept, released):
        assert sorted(weights) == sorted(weights_r)
        assert all(torch.equal(weights[name], weights_r[name]) for name in weights)  # bit for bit
        assert len(state) == len(state_r) and all(torch.equal(a, b) for a, b in zip(state, state_r))
        assert len(seen) == STEPS
        for released_once in seen:
            assert released_once["freed"] > 0
            assert released_once["grads_left"] == 0 and released_once["state_left"] == 0
            assert released_once["parameters_kept"] and released_once["export_same"]

"""The CPU-offloaded optimizer really leaves the GPU: after it is built and after a step, none of its tensors
(fp32 master shards, Adam moments, gradient copies) stays on the GPU, and it steps to the same weights as
the optimizer kept on the GPU. Run on the CPU under ``rlmega.plan.placement.simulated_gpu``, which tells
the tensors Megatron moves to host memory from the rest, as a GPU run would place them."""

import torch

from hf_models import save_tiny_model
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.plan.placement import allocated_bytes, simulated_gpu, storage_key
from rlmega.workers.config import BatchingConfig, OptimizerConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

TIMEOUT_S = 300


def _model_storages(worker) -> set[int]:
    found = {storage_key(param) for chunk in worker.chunks for param in chunk.parameters()}
    for chunk in worker.chunks:
        found |= {storage_key(buffer.grad_data) for buffer in chunk.buffers + chunk.expert_parallel_buffers}
    return found


def _owned_elements(worker) -> int:
    """Elements of this rank's optimizer shard: the bf16 shards the distributed optimizer hands it."""
    return sum(shard.numel() for inner in worker.optimizer.chained_optimizers
               for group in inner.shard_float16_groups for shard in group)


def _step_body(rank, world_size, layout, hf_dir, fraction, root):
    initialize(layout)
    with simulated_gpu():
        config = WorkerConfig(role="actor", dtype="bf16", batching=BatchingConfig(max_tokens_per_microbatch=24),
                              optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, distributed_optimizer=True,
                                                        cpu_offload_fraction=fraction))
        worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir, total_steps=4)
        model = _model_storages(worker)
        built = allocated_bytes(worker.optimizer, model)
        batch = make_batch(1)
        old_logp, _ = worker.compute_logprobs(batch)
        generator = torch.Generator().manual_seed(1)
        worker.update(batch.with_fields(old_logp=old_logp,
                                        advantages=[torch.randn(n, generator=generator) for n in batch.response_lengths]))
        stepped = allocated_bytes(worker.optimizer, model)
        owned = _owned_elements(worker)
    # Saving broadcasts, and torch's collectives ask CUDA about any tensor that says it is on the GPU.
    worker.save_checkpoint(root)
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return built, stepped, owned, weights


def _resume_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    with simulated_gpu():
        config = WorkerConfig(role="actor", dtype="bf16", batching=BatchingConfig(max_tokens_per_microbatch=24),
                              optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, distributed_optimizer=True,
                                                        cpu_offload_fraction=1.0))
        worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, total_steps=4)
    worker.load_checkpoint(root)
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return weights


def test_offloaded_optimizer_state_lives_in_host_memory_and_steps_as_on_the_gpu(tmp_path):
    save_tiny_model("llama", tmp_path / "hf")
    args = (ParallelLayout(), str(tmp_path / "hf"))
    on_gpu = run_on_ranks(_step_body, 1, timeout_s=TIMEOUT_S, args=args + (0.0, str(tmp_path / "gpu")))[0]
    offloaded = run_on_ranks(_step_body, 1, timeout_s=TIMEOUT_S, args=args + (1.0, str(tmp_path / "host")))[0]
    built, stepped, owned, weights = offloaded
    # Built: the fp32 master of every owned element, in host memory only (Megatron 0.16 without the
    # precision-aware optimizer left a second fp32 master on the GPU: 4 bytes per element).
    assert built == {"gpu": 0, "host": 4 * owned}
    # After a step: master, two Adam moments and the fp32 gradient copy (16 bytes per element), all in
    # host memory.
    assert stepped == {"gpu": 0, "host": 16 * owned}
    # Kept on the GPU, the same optimizer holds master and moments there (12 bytes per element).
    gpu_built, gpu_stepped, gpu_owned, gpu_weights = on_gpu
    assert gpu_owned == owned and gpu_built["gpu"] == 4 * owned and gpu_stepped["gpu"] == 12 * owned
    for name, tensor in weights.items():
        assert torch.equal(tensor, gpu_weights[name]), name
    # Its checkpoint loads (Megatron 0.16's default optimizer format could not be saved, a fresh distributed
    # optimizer could not describe itself for a load, and the offloaded one's param groups need torch's classes).
    resumed = run_on_ranks(_resume_body, 1, timeout_s=TIMEOUT_S,
                           args=(ParallelLayout(), str(tmp_path / "hf"), str(tmp_path / "host")))[0]
    for name, tensor in weights.items():
        assert torch.equal(resumed[name], tensor), name

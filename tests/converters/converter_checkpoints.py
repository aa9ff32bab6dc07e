"""Megatron checkpoints as the training workers save them, from live models on gloo ranks.

Each rank job builds a tiny model at a parallel layout with Megatron's own random init, saves
``{"model", "optimizer", "iteration"}`` into ``<root>/iter_0000010/`` with the tracker file beside
it, and collects ``export_hf_weights`` of the same live model on rank 0: the reference the
converter's output must equal bit for bit.
"""

from pathlib import Path

from rlmega.parallel.layout import ParallelLayout
from rlmega.parallel.spawn import run_on_ranks

ITERATION = 10
TIMEOUT_S = 180
CASES = {
    "moe-tp2-pp2-ep2": ("qwen3-moe", dict(tp=2, pp=2, ep=2, world_size=4)),
    "dense-tp2-pp2-vpp2": ("qwen2-tied", dict(tp=2, pp=2, vpp=2, world_size=4)),
    "dense-tp2-cp2": ("llama", dict(tp=2, cp=2, world_size=4)),  # CP ranks hold replicas
}


def _save_and_export(rank, world_size, layout, hf_dir, directory):
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rlmega.bridge import export_hf_weights
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import destroy, initialize
    from rlmega.models.tiny_gpt import build_optimizer

    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    config = spec.transformer_config(layout)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(config, ddp, model) for model in build_chunks(spec, layout, config)]
    optimizer = build_optimizer(chunks)
    if len(chunks) == 1:
        model_state = {"model": chunks[0].module.sharded_state_dict()}
    else:
        model_state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(chunks)}
    # is_loading=True makes Megatron create the Adam moments, so the checkpoint holds optimizer
    # tensors (optimizer.state.exp_avg...) next to the weights, as after a training step.
    optimizer_state = optimizer.sharded_state_dict(model_state, is_loading=True)
    state = {**model_state, "optimizer": optimizer_state, "iteration": ITERATION}
    dist_checkpointing.save(state, directory)
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, spec, destinations=[0])}
    destroy()
    torch.distributed.barrier()
    return exported if rank == 0 else None


def save_checkpoint(hf_dir: Path, root: Path, layout_kwargs: dict):
    """(root with iter_0000010/ and the tracker file, {hf name: tensor} exported from the live model)."""
    iteration_dir = root / f"iter_{ITERATION:07d}"
    iteration_dir.mkdir(parents=True)
    layout = ParallelLayout(**layout_kwargs)
    results = run_on_ranks(_save_and_export, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(hf_dir), str(iteration_dir)))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    return root, results[0]

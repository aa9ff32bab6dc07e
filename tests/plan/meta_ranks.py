"""An independent count of what single ranks of a job hold: each rank's model built as the issue that asked
for the planner measured it (torch's fake process group at the full world size, Megatron's groups without
gloo, the meta device), with the worker's builder, in a child process of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import json, os, sys
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import torch, torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from rlmega.parallel import cpu_platform
cpu_platform.enable()
from megatron.core import parallel_state
from rlmega.config import load_config
from rlmega.models import model_spec_from_hf
from rlmega.workers.model import build_model
import dataclasses


class Meta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def optimizer_bytes(chunks):
    """{"gpu", "host"} bytes of the rank's optimizer after a step, counted by what it holds: the fp32 master
    of each shard (the torch optimizers' parameters), their Adam state, the offloaded gradient copies."""
    from rlmega.plan.placement import on_host, simulated_gpu
    from rlmega.workers.model import build_optimizer

    dist.all_gather_object = lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out))
    with torch.device("meta"), simulated_gpu(meta=True):
        optimizer, _ = build_optimizer(chunks, actor.optimizer, torch.bfloat16, actor.optimizer.lr_warmup_steps + 2,
                                       gloo_groups=False)
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    with simulated_gpu(meta=True):
        for inner in inners:
            for torch_optimizer in [inner.optimizer] + list(getattr(inner.optimizer, "sub_optimizers", [])):
                for group in torch_optimizer.param_groups:
                    group["fused"] = False
            inner._init_optimizer_states_with_dummy_values()
    placed = {"gpu": 0, "host": 0}
    for inner in inners:
        hybrid = inner.optimizer
        held = list(getattr(hybrid, "cpu_copy_map_grad", {}).values())
        for sub in getattr(hybrid, "sub_optimizers", [hybrid]):
            for group in sub.param_groups:
                for param in group["params"]:
                    # The hybrid optimizer also files each master under its state as "master_param".
                    held += [param] + [value for value in sub.state[param].values()
                                       if isinstance(value, torch.Tensor) and value.numel() > 1 and value is not param]
        for tensor in held:
            placed["host" if on_host(tensor) else "gpu"] += tensor.numel() * tensor.element_size()
    return placed


recipe, ranks, with_optimizer = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
config = load_config(recipe, check=False)
layout = config.layout.build()
spec = model_spec_from_hf(config.model.path, mtp=config.model.mtp)
actor = dataclasses.replace(config.actor, dtype="bf16", recompute_granularity=None, recompute_method=None,
                            recompute_num_layers=None, recompute_modules=None,
                            optimizer=dataclasses.replace(config.actor.optimizer, distributed_optimizer=True))
counts = {}
for rank in ranks:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp, create_gloo_process_groups=False)
    with torch.device("meta"), Meta():
        chunks, _ = build_model(spec, layout, actor)
    params = {id(p): p for chunk in chunks for p in chunk.parameters()}
    buffers = [b for chunk in chunks for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]
    optimizer = optimizer_bytes(chunks) if rank in with_optimizer else None
    counts[rank] = dict(
        optimizer=optimizer,
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        param_numel=sum(p.numel() for p in params.values()),
        grad_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        expert_rank=parallel_state.get_expert_model_parallel_rank())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
print("COUNTS " + json.dumps(counts))
'''


def count_ranks(recipe: str, ranks: list[int], with_optimizer: tuple[int, ...] = ()) -> dict[int, dict]:
    """{rank: {param_bytes, param_numel, grad_bytes, pipeline_rank, expert_rank, optimizer}} of the recipe's
    actor; ``optimizer`` ({"gpu", "host"} bytes after a step) for the ranks in ``with_optimizer``."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, recipe, json.dumps(ranks), json.dumps(list(with_optimizer))],
                          capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env=dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""))
    line = next((line for line in done.stdout.splitlines() if line.startswith("COUNTS ")), None)
    assert line is not None, done.stderr[-3000:]
    return {int(rank): value for rank, value in json.loads(line[len("COUNTS "):]).items()}

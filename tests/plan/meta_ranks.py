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


recipe, ranks = sys.argv[1], json.loads(sys.argv[2])
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
    counts[rank] = dict(
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        param_numel=sum(p.numel() for p in params.values()),
        grad_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        expert_rank=parallel_state.get_expert_model_parallel_rank())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
print("COUNTS " + json.dumps(counts))
'''


def count_ranks(recipe: str, ranks: list[int]) -> dict[int, dict]:
    """{rank: {param_bytes, param_numel, grad_bytes, pipeline_rank, expert_rank}} of the recipe's actor."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, recipe, json.dumps(ranks)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env=dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""))
    line = next((line for line in done.stdout.splitlines() if line.startswith("COUNTS ")), None)
    assert line is not None, done.stderr[-3000:]
    return {int(rank): value for rank, value in json.loads(line[len("COUNTS "):]).items()}

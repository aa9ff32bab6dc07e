"""Exact byte counts of every distinct rank position, from that rank's real model built on the meta device.

A child process (``measure``) starts torch's fake process-group backend at the job's full world size,
creates Megatron's groups for one rank of each distinct pipeline stage, and builds that rank's model
with the worker's own builder (``rlmega.workers.model.build_model``: DDP gradient buffers,
``Float16Module``, frozen routers, critic head) on the meta device: every tensor has its real shape and
dtype and none has memory, so a DeepSeek-V3 rank of a 256-GPU job builds in a fraction of a second on
one core. What a rank holds is then read from the objects themselves: parameters (the distributed
optimizer's padded parameter buffer included), module buffers, the DDP gradient buffers, the
distributed optimizer's shard of each bucket for every data-parallel rank (Megatron's own range
computation), and which tensors the rank sends in a weight sync (the bridge's names and ownership).

Stages whose chunks have the same layer kinds (dense / MoE), the same first / last role and MTP are
built once. Tensor-, context-, expert- and data-parallel ranks of a stage hold the same parameters
(Megatron splits evenly); they differ only in the optimizer shard, which is computed for each.

The child runs with CUDA hidden, so it is the same on a laptop and on a GPU node, and its Megatron
state cannot leak into the caller.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from rlmega.errors import UserError

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


class PlanBuildError(UserError):
    """The layout or the model cannot be built as the config asks; the message says why."""


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    spec: object
    """``rlmega.models.ModelSpec``."""
    layout: object
    """``rlmega.parallel.layout.ParallelLayout``."""
    roles: dict
    """{role name: ``WorkerConfig``} of the roles the run builds."""


def measure_in_subprocess(request: BuildRequest, timeout_s: float = 600.0) -> dict:
    """``measure(request)`` in a fresh Python process; a bad layout or model comes back as a
    ``PlanBuildError`` with the child's one-line message, anything else with its traceback."""
    with tempfile.TemporaryDirectory(prefix="rlmega-plan-") as scratch:
        source, target = Path(scratch, "request.pkl"), Path(scratch, "result.pkl")
        source.write_bytes(pickle.dumps(request))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "rlmega.plan.meta_build", str(source), str(target)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if not target.is_file():
            raise RuntimeError(f"the planner's build process exited with code {done.returncode}:\n{done.stderr[-4000:]}")
        result = pickle.loads(target.read_bytes())
    if "error" in result:
        if result["bad_input"]:
            raise PlanBuildError(result["error"])
        raise RuntimeError(f"the planner's build failed:\n{result['traceback']}")
    return result


def build_config(config):
    """The worker config as a GPU run resolves it (bf16, the distributed optimizer with NCCL), with
    the settings that change no tensor and need CUDA or transformer-engine to build left out
    (recomputation, activation offload): the planner accounts for those with its formulas."""
    optimizer = dataclasses.replace(
        config.optimizer,
        distributed_optimizer=True if config.optimizer.distributed_optimizer is None else config.optimizer.distributed_optimizer,
    )
    return dataclasses.replace(config, dtype=config.dtype or "bf16", optimizer=optimizer, recompute_granularity=None,
                               recompute_method=None, recompute_num_layers=None, recompute_modules=None,
                               activation_offload_layers=0)


def _stage_signatures(spec, layout) -> dict:
    """{signature: [pp stages]}: a stage's chunks as (first, last, layer kinds per chunk)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = spec.transformer_config(layout)
    pattern = spec.config.get("moe_layer_freq")
    kinds = ["moe" if (pattern[i] if isinstance(pattern, list) else spec.num_experts) else "dense"
             for i in range(spec.num_layers)]
    groups: dict = {}
    for stage in range(layout.pp):
        chunks = []
        for vp_stage in range(layout.virtual_stages):
            vp = vp_stage if layout.virtual_stages > 1 else None
            first = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=stage)
            count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=stage)
            chunks.append(tuple(kinds[first:first + count]))
        signature = (stage == 0, stage == layout.pp - 1, tuple(chunks))
        groups.setdefault(signature, []).append(stage)
    return groups


def _initialize(rank: int, layout) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    parallel_state.initialize_model_parallel(**layout.megatron_sizes(), create_gloo_process_groups=False)


def _destroy() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class _GroupAt:
    """A stand-in data-parallel group that reports another rank, for Megatron's shard computation."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _owned_per_dp_rank(buffer) -> list[int]:
    """Elements of ``buffer`` whose optimizer state each data-parallel rank holds under the
    distributed optimizer: Megatron's own range map (``DistributedOptimizer._build_model_gbuf_range``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    size = buffer.data_parallel_group.size()
    owned = []
    for dp_rank in range(size):
        # megatron-core 0.19 also checks the shard count the buffer was laid out for (None: not recorded).
        view = dataclasses.make_dataclass(
            "BufferAt", ["buckets", "param_index_map", "data_parallel_group", "num_optimizer_shards"])(
            buffer.buckets, buffer.param_index_map, _GroupAt(dp_rank, size),
            getattr(buffer, "num_optimizer_shards", None))
        owned.append(sum(
            ranges["param"].size
            for index in range(len(buffer.buckets))
            for ranges in DistributedOptimizer._build_model_gbuf_range(view, index)["param_map"].values()
        ))
    return owned


def _ddp_buffers(chunks) -> list[tuple[str, object]]:
    found = []
    for chunk in chunks:
        if isinstance(getattr(chunk, "buffers", None), list):  # Megatron's DDP shadows Module.buffers
            found += [("dense", buffer) for buffer in chunk.buffers]
            found += [("expert", buffer) for buffer in chunk.expert_parallel_buffers]
    return found


def _module_buffer_bytes(chunks) -> int:
    import torch

    seen, total = set(), 0
    for chunk in chunks:
        for buffer in torch.nn.Module.buffers(chunk):
            if id(buffer) not in seen:
                seen.add(id(buffer))
                total += buffer.numel() * buffer.element_size()
    return total


def _parameter_bytes(chunks, buffers) -> tuple[int, int, int]:
    """(bytes, elements, trainable elements) of this rank's parameters: the distributed optimizer's
    parameter buffers as allocated (padding included), and every parameter outside them."""
    import torch

    in_buffer = set()
    total = 0
    for _, buffer in buffers:
        if buffer.param_data is not None:
            total += buffer.param_data.numel() * buffer.param_data.element_size()
            in_buffer.update(id(param) for param in buffer.param_index_map)
    seen, numel, trainable = set(), 0, 0
    for chunk in chunks:
        for param in torch.nn.Module.parameters(chunk):
            if id(param) in seen:
                continue
            seen.add(id(param))
            numel += param.numel()
            trainable += param.numel() if param.requires_grad else 0
            if id(param) not in in_buffer:
                total += param.numel() * param.element_size()
    return total, numel, trainable


def _sync_bytes(chunks, spec, layout) -> dict[str, int]:
    """Bytes of the HF tensors this rank would send in a weight sync if it owned all of its
    parameters (the position's representative is tensor-, data- and expert-data-parallel rank 0),
    by kind: dense tensors split over TP or whole on every TP rank, this rank's experts, and the same
    two kinds of the MTP layers (which the engines do not hold)."""
    from rlmega.bridge.params import gathered_shape, local_params

    sums = dict(dense_split=0, dense_replicated=0, expert=0, mtp_dense=0, mtp_expert=0, largest=0)
    for param in local_params(chunks):
        if param.tied_output:
            continue  # the first stage sends the embedding
        shape = list(gathered_shape(param, layout.expert_tp if param.is_expert else layout.tp))
        if (param.copy_of or param.canonical) in (EMBEDDING, OUTPUT) and spec.score_head is None:
            shape[0] = spec.vocab_size  # the export trims Megatron's vocabulary padding
        nbytes = int(_numel(shape) * param.tensor.element_size())
        sums["largest"] = max(sums["largest"], nbytes)
        if param.canonical.startswith("mtp."):
            sums["mtp_expert" if param.is_expert else "mtp_dense"] += nbytes
        elif param.is_expert:
            sums["expert"] += nbytes
        else:
            sums["dense_split" if param.partition_dim is not None else "dense_replicated"] += nbytes
    return sums


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _build_on_meta(spec, layout, config) -> list:
    """The rank's model chunks as the worker builds them, every tensor on the meta device (Megatron
    allocates its DDP buffers on ``torch.cuda.current_device()``: ``simulated_gpu`` sends them there too)."""
    import torch

    from rlmega.plan.placement import simulated_gpu
    from rlmega.workers.model import build_model

    with torch.device("meta"), simulated_gpu(meta=True):
        chunks, _ = build_model(spec, layout, build_config(config))
    return chunks


def _measure_role(chunks, spec, layout) -> dict:
    buffers = _ddp_buffers(chunks)
    param_bytes, numel, trainable = _parameter_bytes(chunks, buffers)
    return dict(
        param_bytes=param_bytes,
        param_numel=numel,
        trainable_numel=trainable,
        module_buffer_bytes=_module_buffer_bytes(chunks),
        grad_bytes=sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for _, buffer in buffers),
        grad_buffers=[dict(kind=kind, numel=buffer.grad_data.numel(), dp_size=buffer.data_parallel_group.size(),
                           owned_per_dp_rank=_owned_per_dp_rank(buffer))
                      for kind, buffer in buffers],
        sync_bytes=_sync_bytes(chunks, spec, layout),
        chunks=len(chunks),
    )


def worst_owner(role: dict, local_ranks: int, layout) -> tuple[int, int]:
    """(rank index inside the stage, elements) of the stage's rank with the largest optimizer shard."""
    best = (0, 0)
    for index in range(local_ranks):
        at = StageCoordinates.of(index, layout)
        owned = sum(buffer["owned_per_dp_rank"][at.data_parallel_index if buffer["kind"] == "dense"
                                                else at.expert_data_parallel_rank]
                    for buffer in role["grad_buffers"])
        best = max(best, (owned, -index))
    return -best[1], best[0]


def _gathers_own_object(output: list, obj, group=None) -> None:
    """all_gather_object under the fake process group: every rank's object is this rank's (Megatron
    gathers the optimizer's param-group keys, the same on every rank of a stage)."""
    output[:] = [obj] * len(output)


def _measure_optimizer(chunks, config) -> dict:
    """{"gpu", "host"}: bytes of the optimizer this rank builds (the worker's own ``build_optimizer``)
    once a step has made its state (Megatron's ``_init_optimizer_states_with_dummy_values``), by where a
    GPU run keeps them (``rlmega.plan.placement``), the model's parameters and gradients left out."""
    import torch
    import torch.distributed as dist

    from rlmega.plan.placement import allocated_bytes, simulated_gpu, storage_key
    from rlmega.workers.model import build_optimizer
    from rlmega.workers.optimizer_state import sub_optimizers

    built = build_config(config)
    model = {storage_key(param) for chunk in chunks for param in torch.nn.Module.parameters(chunk)}
    for _, buffer in _ddp_buffers(chunks):
        model |= {storage_key(tensor) for tensor in (buffer.param_data, buffer.grad_data) if tensor is not None}
    dist.all_gather_object = _gathers_own_object  # this child process only
    with torch.device("meta"), simulated_gpu(meta=True):
        optimizer, _ = build_optimizer(chunks, built.optimizer, torch.bfloat16,
                                       total_steps=built.optimizer.lr_warmup_steps + 2, gloo_groups=False)
    with simulated_gpu(meta=True):  # outside torch.device("meta"): Adam's step count stays a real CPU scalar
        for inner in sub_optimizers(optimizer):
            # torch's fused CPU Adam refuses meta tensors; unfused, it allocates the same state.
            for torch_optimizer in [inner.optimizer] + list(getattr(inner.optimizer, "sub_optimizers", [])):
                for group in torch_optimizer.param_groups:
                    group["fused"] = False
            inner._init_optimizer_states_with_dummy_values()
    return allocated_bytes(optimizer, model)


def measure(request: BuildRequest) -> dict:
    """{"positions": [{"stages", "first", "last", "layer_kinds", "roles": {role: counts}}]}; a trained
    role's ``optimizer`` is measured on the stage's rank with the largest shard (``optimizer_index``)."""
    from rlmega.parallel import cpu_platform

    cpu_platform.enable()
    spec, layout = request.spec, request.layout
    spec.check_layout(layout)
    _initialize(0, layout)
    try:
        signatures = _stage_signatures(spec, layout)
    finally:
        _destroy()
    positions = []
    per_stage = layout.world_size // layout.pp
    for (first, last, layer_kinds), stages in signatures.items():
        roles = {}
        for name, config in request.roles.items():
            _initialize(stages[0] * per_stage, layout)
            try:
                chunks = _build_on_meta(spec, layout, config)
                roles[name] = role = _measure_role(chunks, spec, layout)
                if role["grad_buffers"]:
                    distributed = config.optimizer.distributed_optimizer is not False  # None: on, as on a GPU
                    role["optimizer_index"], role["owned"] = (worst_owner(role, per_stage, layout) if distributed
                                                              else (0, role["trainable_numel"]))
                    if role["optimizer_index"] == 0:  # the stage's first rank is the worst: measure it here
                        role["optimizer"] = _measure_optimizer(chunks, config)
            finally:
                _destroy()
            if role["grad_buffers"] and "optimizer" not in role:
                _initialize(stages[0] * per_stage + role["optimizer_index"], layout)
                try:
                    role["optimizer"] = _measure_optimizer(_build_on_meta(spec, layout, config), config)
                finally:
                    _destroy()
        positions.append(dict(stages=stages, first=first, last=last, layer_kinds=[list(k) for k in layer_kinds],
                              mtp_layers=spec.mtp_num_layers if last else 0, roles=roles))
    return dict(positions=positions)


def _main(source: str, target: str) -> None:
    request = pickle.loads(Path(source).read_bytes())
    try:
        result: dict = measure(request)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which decides how to show it
        result = dict(error=" ".join(str(error).split()), bad_input=isinstance(error, ValueError),
                      traceback=traceback.format_exc())
    Path(target).write_bytes(pickle.dumps(result))


@dataclasses.dataclass(frozen=True)
class StageCoordinates:
    """Where the rank with index ``i`` inside its pipeline stage sits: Megatron orders a stage's ranks
    tp-cp-dp for the dense layers and etp-ep-edp for the experts (``tests/plan`` checks it against
    ``parallel_state``)."""

    tp_rank: int
    data_parallel_index: int
    """Rank in the data-parallel group with context parallelism (the dense gradient buffers' group)."""
    expert_tp_rank: int
    expert_rank: int
    expert_data_parallel_rank: int

    @classmethod
    def of(cls, index: int, layout) -> "StageCoordinates":
        etp = layout.expert_tp
        return cls(tp_rank=index % layout.tp, data_parallel_index=index // layout.tp, expert_tp_rank=index % etp,
                   expert_rank=(index // etp) % layout.ep, expert_data_parallel_rank=index // (etp * layout.ep))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])

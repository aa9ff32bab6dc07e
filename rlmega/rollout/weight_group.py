"""A process group between one trainer rank (rank 0) and an engine's workers, for broadcasting weights.

The disaggregated mode of the vLLM and SGLang adapters: the engine runs on its own GPUs, and the trainer
rank that holds the exported HF tensors broadcasts them, one tensor after another, to every engine worker
(tensor-parallel workers each receive the whole tensor and keep their shard in ``load_weights``).

The group is made the way SGLang 0.5.3 makes its weight-update group (``init_custom_process_group`` in
``python/sglang/srt/utils/common.py``): a TCP rendezvous at ``tcp://master_address:master_port``, a store
prefixed by the group name, and a group that does not need, or disturb, the default process group of
either side. The trainer side of SGLang's group and the engine side of the vLLM adapter both use this
function, so one sender (``broadcast_weights``) serves both engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "rlmega_weight_update"
WeightMeta = tuple[str, str, tuple[int, ...]]  # (on-disk name, dtype name such as "bfloat16", shape)


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl",
                             timeout: timedelta = timedelta(minutes=10)) -> dist.ProcessGroup:
    """Join the weight-update group as ``rank`` (0: the trainer; engine workers: 1..world_size-1).

    Collective over all ``world_size`` members. ``backend`` is "nccl" on GPUs, "gloo" for CPU tests.
    """
    # torch has no public call for a process group that is not a subgroup of the default one; these
    # private c10d helpers are the ones SGLang uses for the same group, audited against torch 2.6-2.13.
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # lets broadcast(src=0, group=...) resolve
    return group


def weight_meta(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[WeightMeta]:
    """What receivers need to allocate a bucket: names, dtypes, shapes."""
    return [(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for name, tensor in named_tensors]


def broadcast_weights(group: dist.ProcessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Trainer side (rank 0): broadcast each tensor, in order. The engine side must be receiving the same
    names in the same order (``receive_weights``, or SGLang's ``update_weights_from_distributed``)."""
    handles = [dist.broadcast(_as_bytes(tensor.contiguous()), src=0, group=group, async_op=True)
               for _, tensor in named_tensors]
    for handle in handles:
        handle.wait()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 tensors travel as their bytes: gloo has no FP8 type (NCCL moves FP8 as bytes either way)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def receive_weights(group: dist.ProcessGroup, metas: Sequence[WeightMeta],
                    device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive the tensors that rank 0 broadcasts for ``metas``."""
    received, handles = [], []
    for name, dtype, shape in metas:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        handles.append(dist.broadcast(_as_bytes(tensor), src=0, group=group, async_op=True))
        received.append((name, tensor))
    for handle in handles:
        handle.wait()
    return received

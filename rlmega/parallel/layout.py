"""The parallel layout: every parallel degree in one validated object, and Megatron's groups from it.

Megatron orders ranks ``tp-cp-ep-dp-pp`` (tensor fastest). Dense layers see
``world = tp * cp * dp * pp``; expert layers re-fold the same ranks as
``world = etp * ep * edp * pp``, so ``ep * etp`` must divide ``tp * cp * dp``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Optional

import torch
import torch.distributed as dist


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the offending numbers."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees of one training job. ``dp`` is derived from the world size."""

    tp: int = 1
    """Tensor parallel: splits attention heads and MLP columns inside each layer."""
    pp: int = 1
    """Pipeline parallel: splits the layers into consecutive stages."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None or 1 means plain 1F1B."""
    cp: int = 1
    """Context parallel: splits the sequence; needs transformer-engine (GPU only)."""
    ep: int = 1
    """Expert parallel: splits the experts of MoE layers."""
    etp: Optional[int] = None
    """Expert tensor parallel: splits each expert's weights; None means 1 (no split) under ep > 1, else tp."""
    world_size: int = 1
    """Total number of ranks in the job."""
    first_stage_layers: Optional[int] = None
    """Layers on the first pipeline stage when stages are uneven (the rest split evenly); None: even."""
    last_stage_layers: Optional[int] = None
    """Layers on the last pipeline stage when stages are uneven; None: even."""

    def __post_init__(self):
        for name in ("tp", "pp", "cp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be at least 1")
        if self.vpp is not None and self.vpp < 1:
            raise LayoutError(f"vpp={self.vpp} must be at least 1 (or None)")
        if self.etp is not None and self.etp < 1:
            raise LayoutError(f"etp={self.etp} must be at least 1 (or None)")
        model_parallel = self.tp * self.cp * self.pp
        if self.world_size % model_parallel:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {model_parallel}"
            )
        if self.virtual_stages > 1 and self.pp == 1:
            raise LayoutError(f"vpp={self.vpp} needs pipeline parallelism, but pp=1")
        if self.uneven_stages:
            if self.pp == 1:
                raise LayoutError("first_stage_layers/last_stage_layers need pipeline parallelism, but pp=1")
            if self.virtual_stages > 1:
                raise LayoutError(f"uneven pipeline stages with vpp={self.vpp} are not supported; use vpp=1")
        dense_ranks = self.tp * self.cp * self.dp
        if dense_ranks % (self.ep * self.expert_tp):
            raise LayoutError(
                f"ep*etp = {self.ep}*{self.expert_tp} must divide tp*cp*dp = "
                f"{self.tp}*{self.cp}*{self.dp} = {dense_ranks}"
            )

    @property
    def dp(self) -> int:
        """Data parallel degree of the dense layers."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        """Effective expert tensor parallel degree."""
        if self.etp is not None:
            return self.etp
        return 1 if self.ep > 1 else self.tp

    @property
    def expert_dp(self) -> int:
        """Data parallel degree of the expert layers."""
        return self.world_size // (self.pp * self.ep * self.expert_tp)

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    @property
    def uneven_stages(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: Optional[int] = None,
        num_experts: Optional[int] = None,
    ) -> None:
        """Raise LayoutError unless the model can be split this way."""
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}"
            )
        groups = num_query_groups or num_attention_heads
        if groups % self.tp:
            raise LayoutError(f"num_query_groups={groups} is not divisible by tp={self.tp}")
        if self.uneven_stages:
            self._check_uneven_stages(num_layers)
        elif num_layers % (self.pp * self.virtual_stages):
            raise LayoutError(
                f"num_layers={num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.virtual_stages} = {self.pp * self.virtual_stages}"
            )
        if self.ep > 1 and not num_experts:
            raise LayoutError(f"ep={self.ep} needs a MoE model, but the model has no experts")
        if num_experts and num_experts % self.ep:
            raise LayoutError(f"num_experts={num_experts} is not divisible by ep={self.ep}")

    def _check_uneven_stages(self, num_layers: int) -> None:
        first, last = self.first_stage_layers or 0, self.last_stage_layers or 0
        middle_stages = self.pp - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
        middle_layers = num_layers - first - last
        if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
            raise LayoutError(
                f"num_layers={num_layers} minus first_stage_layers={first} and last_stage_layers={last} "
                f"leaves {middle_layers} layers, which do not split evenly over the other {middle_stages} stage(s)"
            )

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.virtual_stages > 1 else ""
        return (
            f"tp={self.tp} pp={self.pp}{vpp} cp={self.cp} ep={self.ep} etp={self.expert_tp} "
            f"dp={self.dp} (world {self.world_size})"
        )


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions ``[length / cp]`` of a sequence held by CP ``rank``: chunks ``rank`` and
    ``2cp-1-rank`` of ``2cp`` equal chunks (the split Megatron's rotary embedding assumes)."""
    if length % (2 * cp):
        raise ValueError(f"a context-parallel segment of {length} tokens is not a multiple of 2*cp = {2 * cp}")
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def default_backend() -> str:
    """NCCL where CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(layout: ParallelLayout, *, timeout_s: float = 300.0, seed: int = 1234) -> None:
    """Create Megatron's process groups for ``layout``, on NCCL with CUDA and on gloo without,
    and seed Megatron's per-group RNG streams (dropout, initialisation) from ``seed``.

    Starts ``torch.distributed`` first when nobody has, from the variables torchrun sets (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT). On CPU it also enables the platform redirects.
    """
    from megatron.core import parallel_state

    from rlmega.parallel import cpu_platform

    if not dist.is_initialized():
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialised and {', '.join(missing)} not set; "
                "launch with torchrun or call torch.distributed.init_process_group first"
            )
        dist.init_process_group(default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"layout is for world size {layout.world_size}, but torch.distributed has "
            f"{dist.get_world_size()} ranks"
        )
    cpu_platform.enable()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.virtual_stages > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy(*, including_default_group: bool = False) -> None:
    """Tear down Megatron's process groups, and the default group too when asked."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if including_default_group and dist.is_initialized():
        dist.destroy_process_group()


def _layout_config_class() -> type:
    """``ParallelLayout``'s fields as a mutable dataclass, for the config tree (Hydra and OmegaConf
    merge overrides into mutable nodes); one description of the layout, so the two cannot drift."""
    import typing

    hints = typing.get_type_hints(ParallelLayout)
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(ParallelLayout)]
    namespace = {
        "__doc__": "The parallel layout of the training ranks as configured (see ``ParallelLayout``).",
        "__module__": __name__,  # pickled by reference, like any class of this module
        "build": lambda self: ParallelLayout(**dataclasses.asdict(self)),
    }
    return dataclasses.make_dataclass("LayoutConfig", fields, namespace=namespace)


LayoutConfig = _layout_config_class()

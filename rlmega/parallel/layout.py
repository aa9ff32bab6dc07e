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

    def megatron_sizes(self) -> dict[str, Optional[int]]:
        """The parallel sizes as Megatron-Core names them (``initialize_model_parallel`` and
        ``TransformerConfig`` take the same keywords)."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.virtual_stages > 1 else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )

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
        ffn_hidden_size: Optional[int] = None,
        expert_ffn_hidden_size: Optional[int] = None,
    ) -> None:
        """Raise LayoutError unless the model can be split this way; the message proposes degrees
        (or uneven stages) that can."""
        groups = num_query_groups or num_attention_heads
        for name, size in (("num_attention_heads", num_attention_heads), ("num_query_groups", groups),
                           ("ffn_hidden_size", ffn_hidden_size)):
            if size and size % self.tp:
                raise LayoutError(f"{name}={size} is not divisible by tp={self.tp}; "
                                  f"valid tp: {_divisors_of_all(num_attention_heads, groups, ffn_hidden_size)}")
        if self.uneven_stages:
            self._check_uneven_stages(num_layers)
        elif num_layers % (self.pp * self.virtual_stages):
            raise LayoutError(
                f"num_layers={num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.virtual_stages} = {self.pp * self.virtual_stages}; "
                f"{_stage_proposal(num_layers, self.pp, self.virtual_stages)}"
            )
        if not num_experts:
            if self.ep > 1:
                raise LayoutError(f"ep={self.ep} needs a MoE model, but the model has no experts")
            if self.etp is not None and self.etp != self.tp:
                raise LayoutError(f"etp={self.etp} splits experts, but the model has none; leave etp unset")
            return
        if num_experts % self.ep:
            raise LayoutError(f"num_experts={num_experts} is not divisible by ep={self.ep}; "
                              f"valid ep: {self._valid_ep(num_experts)}")
        if expert_ffn_hidden_size and expert_ffn_hidden_size % self.expert_tp:
            raise LayoutError(f"the experts' ffn_hidden_size={expert_ffn_hidden_size} is not divisible by "
                              f"etp={self.expert_tp}; valid etp: {_divisors_of_all(expert_ffn_hidden_size, self.tp * self.cp * self.dp)}")

    def _valid_ep(self, num_experts: int) -> str:
        """Expert-parallel degrees that split the experts and fit the dense ranks at this etp."""
        dense_ranks = self.tp * self.cp * self.dp
        return _listed(e for e in range(1, num_experts + 1) if not num_experts % e and not dense_ranks % (e * self.expert_tp))

    def _check_uneven_stages(self, num_layers: int) -> None:
        first, last = self.first_stage_layers or 0, self.last_stage_layers or 0
        middle_stages = self.pp - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
        middle_layers = num_layers - first - last
        if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
            raise LayoutError(
                f"num_layers={num_layers} minus first_stage_layers={first} and last_stage_layers={last} "
                f"leaves {middle_layers} layers, which do not split evenly over the other {middle_stages} stage(s); "
                f"{_stage_proposal(num_layers, self.pp)}"
            )

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.virtual_stages > 1 else ""
        uneven = "".join(f" {name}={getattr(self, name)}" for name in ("first_stage_layers", "last_stage_layers")
                         if getattr(self, name) is not None)
        return (
            f"tp={self.tp} pp={self.pp}{vpp}{uneven} cp={self.cp} ep={self.ep} etp={self.expert_tp} "
            f"dp={self.dp} (world {self.world_size})"
        )


def _listed(values) -> str:
    return ", ".join(str(value) for value in values) or "none"


def _divisors_of_all(*sizes: Optional[int]) -> str:
    sizes = [size for size in sizes if size]
    return _listed(d for d in range(1, min(sizes) + 1) if all(size % d == 0 for size in sizes))


def uneven_stage_options(num_layers: int, pp: int) -> list[tuple[Optional[int], Optional[int], int]]:
    """(first_stage_layers, last_stage_layers, layers per other stage) that split ``num_layers`` over
    ``pp`` stages, best first: the other stages as even as possible, the first and last (which also
    hold the embedding and the LM head) no heavier than them and as close to them as possible."""
    options = []
    for middle in range(max(1, num_layers // pp), -(-num_layers // max(1, pp - 2)) + 1):
        for first in (None, *range(1, middle + 1)):
            for last in (None, *range(1, middle + 1)):
                inner = pp - (first is not None) - (last is not None)
                rest = num_layers - (first or 0) - (last or 0)
                even = (first or middle) == (last or middle) == middle
                if not even and inner > 0 and rest == inner * middle:
                    options.append((first, last, middle))
    # Ties: the last stage (which computes the logits) no heavier than the first.
    return sorted(options, key=lambda o: (o[2], -min(o[0] or o[2], o[1] or o[2]), (o[0] is None) + (o[1] is None),
                                          (o[1] or o[2]) - (o[0] or o[2])))


def _stage_proposal(num_layers: int, pp: int, vpp: int = 1) -> str:
    even = [p for p in range(1, num_layers + 1) if num_layers % p == 0]
    if vpp > 1:
        return f"uneven stages need vpp=1; pp*vpp values that split it evenly: {_listed(even)}"
    options = uneven_stage_options(num_layers, pp) if pp > 1 else []
    proposals = [f"leave both unset ({num_layers // pp} on every stage)"] if pp > 1 and num_layers % pp == 0 else []
    for first, last, middle in options[:2]:
        named = " ".join(f"{n}={v}" for n, v in (("first_stage_layers", first), ("last_stage_layers", last)) if v)
        proposals.append(f"set {named} ({middle} on each other stage)")
    uneven = f"with pp={pp}: {' or '.join(proposals)}; " if proposals else ""
    return f"{uneven}pp values that split it evenly: {_listed(even)}"


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions ``[length / cp]`` of a sequence held by CP ``rank``: chunks ``rank`` and
    ``2cp-1-rank`` of ``2cp`` equal chunks (the split Megatron's rotary embedding assumes)."""
    if length % (2 * cp):
        raise ValueError(f"a context-parallel segment of {length} tokens is not a multiple of 2*cp = {2 * cp}")
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def default_backend() -> str:
    """Where CUDA is usable, NCCL for CUDA tensors and gloo for CPU ones: the metrics, counts and objects
    rlmega reduces on the host stay there (NCCL moves only CUDA tensors), and every group Megatron makes
    from the default takes both. Gloo alone otherwise."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def initialize(layout: ParallelLayout, *, timeout_s: float = 300.0, seed: int = 1234,
               host_collectives: bool = True) -> None:
    """Create Megatron's process groups for ``layout`` on ``default_backend()``,
    and seed Megatron's per-group RNG streams (dropout, initialisation) from ``seed``.

    Starts ``torch.distributed`` first when nobody has, from the variables torchrun sets (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT). On CPU it also enables the platform redirects, and (unless
    ``host_collectives`` is False) sends the collectives of ranks on one host through shared memory
    (``rlmega.parallel.host_collectives``).
    """
    from megatron.core import parallel_state

    from rlmega.parallel import cpu_platform, mcore_without_te
    from rlmega.parallel.gloo_interface import bind_gloo_where_ranks_meet

    if not dist.is_initialized():
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialised and {', '.join(missing)} not set; "
                "launch with torchrun or call torch.distributed.init_process_group first"
            )
        bind_gloo_where_ranks_meet([os.environ["MASTER_ADDR"]])
        dist.init_process_group(default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"layout is for world size {layout.world_size}, but torch.distributed has "
            f"{dist.get_world_size()} ranks"
        )
    cpu_platform.enable()
    mcore_without_te.apply()
    parallel_state.initialize_model_parallel(
        **layout.megatron_sizes(), distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if cpu_platform.is_enabled() and host_collectives:
        # The update's tensor-parallel all-reduces, its checks' (model-parallel and world) and the export's TP
        # gathers: through shared memory where the group's ranks share a host. Megatron batches only its
        # data-parallel gradient reductions (a coalescing manager), so those groups stay on gloo.
        cpu_platform.route_collectives([dist.group.WORLD, parallel_state.get_tensor_model_parallel_group(),
                                        parallel_state.get_model_parallel_group()], timeout_s)


def destroy(*, including_default_group: bool = False) -> None:
    """Tear down Megatron's process groups, and the default group too when asked."""
    from megatron.core import parallel_state

    from rlmega.parallel import cpu_platform

    cpu_platform.unroute_collectives()
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

"""On-policy distillation's teachers in the plan: each teacher's weights per GPU, measured like the policy's.

A teacher has ranks of its own (``teacher.layout``), built here on the meta device as its workers build them (no
optimizer, no gradient buffers; ``teacher.dtype``, bf16 by default on GPUs). A teacher whose ranks ask a fraction of
a GPU (``teacher.gpus_per_rank`` < 1) shares the actor's GPUs: its fullest rank's weights count on every training
GPU (times the teacher ranks one GPU holds when it has more ranks than the actor), in every phase, or, offloaded
(``teacher.offload``), in the log-prob phase only, where it scores the responses, and in host memory otherwise. A
teacher with whole GPUs of its own is reported on its own GPUs.
"""

from __future__ import annotations

import dataclasses
import math

from rlmega.plan.meta_build import BuildRequest, PlanBuildError


@dataclasses.dataclass
class TeacherPlan:
    name: str
    """``teacher``, or ``teacher.per_data_source.<source>``."""
    layout: str
    world_size: int
    dtype: str
    rank_bytes: float
    """Parameters and module buffers of the teacher's fullest rank."""
    colocated: bool
    """Its ranks share the actor's GPUs (``gpus_per_rank`` < 1); else each has GPUs of its own."""
    ranks_per_gpu: int
    """Colocated: the teacher's ranks on one training GPU."""
    offload: bool
    gpus: int
    """GPUs of its own (0 when colocated)."""

    @property
    def gpu_bytes(self) -> float:
        """What its ranks hold on one GPU they are placed on, when onloaded."""
        return self.rank_bytes * self.ranks_per_gpu


def plan_teachers(config, measure) -> list[TeacherPlan]:
    """Every teacher of an enabled ``teacher`` section, measured with ``measure`` (``meta_build``); a teacher that
    cannot be built in its layout is a ``PlanBuildError`` naming its field."""
    from rlmega.models import UnsupportedModelError, model_spec_from_hf

    if not config.teacher.enable:
        return []
    teachers = []
    for source, settings in config.teacher.models().items():
        name = "teacher" if source is None else f"teacher.per_data_source.{source}"
        try:
            spec = model_spec_from_hf(settings.path)
            layout = settings.layout.build()
            spec.check_layout(layout)
        except (UnsupportedModelError, FileNotFoundError, ValueError, TypeError) as error:
            raise PlanBuildError(f"{name}: {error}") from None
        worker = settings.worker_config()
        positions = measure(BuildRequest(spec, layout, {"teacher": worker}))["positions"]
        rank_bytes = max(p["roles"]["teacher"]["param_bytes"] + p["roles"]["teacher"]["module_buffer_bytes"]
                         for p in positions)
        colocated = settings.gpus_per_rank < 1
        teachers.append(TeacherPlan(
            name=name, layout=layout.describe(), world_size=layout.world_size, dtype=worker.dtype or "bf16",
            rank_bytes=float(rank_bytes), colocated=colocated,
            ranks_per_gpu=math.ceil(layout.world_size / config.layout.world_size) if colocated else 1,
            offload=settings.offload,
            gpus=0 if colocated else math.ceil(layout.world_size * settings.gpus_per_rank)))
    return teachers

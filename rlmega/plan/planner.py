"""``make_plan(config)``: per rank position, role and phase of a step, what a run's GPUs and hosts hold,
what its engines hold, and what a weight sync moves.

Measured (``meta_build``): parameters, module buffers, gradient buffers, each data-parallel rank's
optimizer shard, the bytes each rank sends in a sync. Formulas (``formulas``): activations, KV cache,
optimizer bytes per element. The phases follow the trainer (``rlmega/trainer/controller.py``):

- generate: colocated, the trained roles are in host memory and the engines awake (weights, KV cache,
  workspace: ``rollout.gpu_memory_utilization`` of the GPU); disaggregated, the trainer just waits;
- logprobs: the trained roles back on the GPU, the reference onloaded for its pass, forward activations
  (colocated engines asleep, level 1: their weights in host memory); an offloaded distillation teacher
  onloaded for its pass (a teacher on the actor's GPUs that is not offloaded is there in every phase);
- update: the trained roles with the training activations of the micro-batches in flight;
- sync: the trained roles, the export's buckets, and, colocated, the engines woken whole to receive.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Optional

from rlmega.errors import UserError
from rlmega.plan import formulas
from rlmega.plan.meta_build import BuildRequest, measure_in_subprocess
from rlmega.plan.phases import SOURCES, Holdings, Term, phase_terms
from rlmega.plan.refit import Refit, plan_refit
from rlmega.plan.teacher import TeacherPlan, plan_teachers
from rlmega.rollout.engine_bytes import EngineLayout, engine_rank_bytes

GIB = 1024**3


class PlanError(UserError):
    """The run does not fit, or cannot be planned; the message names the rank, the phase and the shortfall."""


@dataclasses.dataclass
class RoleMemory:
    params: int
    buffers: int
    grads: int
    optimizer_gpu: float
    optimizer_host: float
    optimizer_variants: dict[str, float]
    """GPU bytes of the optimizer shard as ``formulas.OPTIMIZER_VARIANTS`` (cpu_offload: host bytes)."""
    owned_elements: int
    """Elements of the worst rank's optimizer shard."""
    param_elements: int
    """Parameter elements on the rank (``params`` is what they take, with the distributed optimizer's padding)."""

    @property
    def state(self) -> float:
        return self.params + self.buffers + self.grads + self.optimizer_gpu


@dataclasses.dataclass
class Position:
    stages: list[int]
    ranks: list[tuple[int, int]]
    """[first, last] rank ranges of the stages."""
    layers: str
    worst_rank: int
    roles: dict[str, RoleMemory]
    activations: dict[str, float]
    """Training activations of the stage's in-flight micro-batches: none, full, configured; forward."""
    engine: float
    """The colocated engine's share of this GPU (0 when disaggregated)."""
    export_buffer: float
    terms: dict[str, list[Term]]
    """{phase: what the GPU holds in it}."""
    host_terms: list[Term]
    """What the rank's host memory holds at its peak."""

    @property
    def phases(self) -> dict[str, float]:
        return {phase: sum(term.bytes for term in terms) for phase, terms in self.terms.items()}

    @property
    def host(self) -> float:
        return sum(term.bytes for term in self.host_terms)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclasses.dataclass
class Engine:
    gpus: int
    weights: float
    """Per engine GPU."""
    workspace: float
    kv_cache: float
    kv_bytes_per_token: float
    kv_tokens: int
    """Tokens of KV cache one engine replica (its tp GPUs) holds."""
    tokens_needed: int
    """Tokens of every sequence one replica generates in a step, at full length."""
    weight_dtype: str = "auto"
    """``rollout.weight_dtype``: fp8 engines hold their linear weights in blockwise FP8."""


@dataclasses.dataclass
class Plan:
    config_name: str
    architecture: str
    parameters: int
    mtp_parameters: int
    notes: list[str]
    layout: str
    gpu: str
    gpu_memory: float
    nodes: int
    tokens_per_microbatch: int
    microbatches: int
    recompute: str
    placement: str
    positions: list[Position]
    engine: Engine
    refit: Refit
    host_per_node: float
    host_memory: float
    min_headroom: float
    world_size: int
    ranks_per_stage: int
    pipeline: tuple[int, int]
    """(pp, vpp)."""
    shortfalls: list[str] = dataclasses.field(default_factory=list)
    teachers: list[TeacherPlan] = dataclasses.field(default_factory=list)
    """On-policy distillation's teachers (``plan/teacher.py``); the colocated ones are in the positions' phases."""

    @property
    def bubble(self) -> float:
        """The pipeline's idle share of a mini-batch: (pp - 1) / (vpp x m + pp - 1), Megatron's 1F1B
        schedule and its interleaved form (Narayanan et al. 2021, section 2.2)."""
        pp, vpp = self.pipeline
        return (pp - 1) / (vpp * self.microbatches + pp - 1)

    def position_of_rank(self, rank: int) -> Position:
        stage = rank // self.ranks_per_stage
        return next(p for p in self.positions if stage in p.stages)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for position, raw in zip(self.positions, data["positions"]):
            raw.update(phases=position.phases, host=position.host, peak_phase=position.peak_phase)
            raw["free"] = self.gpu_memory - position.phases[position.peak_phase]
        for leg, raw in zip(self.refit.legs, data["refit"]["legs"]):
            raw["seconds"] = leg.seconds
        data["refit"].update(seconds_overlapped=self.refit.seconds_overlapped, seconds_serial=self.refit.seconds_serial)
        for name in ("sliced", "target"):
            if getattr(self.refit, name) is not None:
                data["refit"][name]["seconds"] = getattr(self.refit, name).seconds
        data["fits"] = not self.shortfalls
        data["bubble"] = self.bubble
        data["units"] = "bytes, seconds, GB/s (1e9 bytes)"
        data["sources"] = SOURCES
        return data


def _roles(config) -> dict:
    roles = {"actor": config.actor}
    if config.builds_reference_model:
        roles["ref"] = config.ref
    if config.needs_critic:
        roles["critic"] = config.critic
    return roles


def _role_memory(role: dict) -> tuple[RoleMemory, int]:
    """A role's memory on the stage's rank with the largest optimizer shard, and that rank's index."""
    if not role["grad_buffers"]:  # not trained: parameters only
        return RoleMemory(role["param_bytes"], role["module_buffer_bytes"], 0, 0.0, 0.0, {}, 0, role["param_numel"]), 0
    owned = role["owned"]
    variants = {name: float(owned * (per_gpu or per_host))
                for name, (per_gpu, per_host) in formulas.OPTIMIZER_VARIANTS.items()}
    return RoleMemory(role["param_bytes"], role["module_buffer_bytes"], role["grad_bytes"],
                      float(role["optimizer"]["gpu"]), float(role["optimizer"]["host"]), variants, owned,
                      role["param_numel"]), role["optimizer_index"]


def microbatch_tokens(config, layout) -> tuple[int, int]:
    """(tokens of one micro-batch on one rank, micro-batches per mini-batch) when every sequence has
    its full length (prompt and response)."""
    batching = config.actor.batching
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    tokens = max(batching.max_tokens_per_microbatch, math.ceil(longest / layout.cp))
    sequences = config.trainer.prompts_per_step * config.rollout.n / (config.actor.ppo_mini_batches * layout.dp)
    microbatches = max(batching.min_microbatches, math.ceil(sequences * longest / (batching.max_tokens_per_microbatch * layout.cp)))
    if layout.virtual_stages > 1:
        microbatches = math.ceil(microbatches / layout.pp) * layout.pp
    return tokens, microbatches


def _hf_config(path: str) -> dict:
    path = Path(path)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def engine_plan(config, shape, preset) -> Engine:
    rollout = config.rollout
    tp, dp = rollout.tensor_parallel_size, rollout.data_parallel_size
    # vLLM's expert parallelism spans the engine's TP x DP ranks; each rank's weights as vLLM lays them out
    # (MLA's down-projections and the routers whole on every rank).
    engine_layout = EngineLayout(tensor_parallel_size=tp, data_parallel_size=dp,
                                 expert_parallel_size=tp * dp if rollout.expert_parallel_size > 1 else 1,
                                 weight_dtype=rollout.weight_dtype)
    weights = engine_rank_bytes(_hf_config(config.model.path), engine_layout).max_sliced
    share = rollout.gpu_memory_utilization * preset.memory_gib * GIB
    workspace = config.plan.engine_workspace_gib * GIB
    kv = share - weights - workspace
    per_token = formulas.kv_bytes_per_token(shape, tp)
    sequences = config.trainer.prompts_per_step * rollout.n / (rollout.num_engines * dp)
    needed = int(math.ceil(sequences) * (config.data.max_prompt_length + rollout.max_new_tokens))
    return Engine(gpus=rollout.num_engines * tp * dp, weights=weights, workspace=workspace, kv_cache=kv,
                  kv_bytes_per_token=per_token, kv_tokens=int(max(kv, 0) // per_token), tokens_needed=needed,
                  weight_dtype=rollout.weight_dtype)


def _layers_label(position: dict) -> str:
    kinds = [kind for chunk in position["layer_kinds"] for kind in chunk]
    parts = [f"{kinds.count(kind)} {kind}" for kind in ("dense", "moe") if kinds.count(kind)]
    if position["mtp_layers"]:
        parts.append(f"{position['mtp_layers']} mtp")
    return " + ".join(parts) or "none"


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every position's accounting reads, resolved once."""

    config: object
    roles: dict
    layout: object
    shape: formulas.Shape
    tokens: int
    microbatches: int
    engine: Engine
    sequence_parallel: bool
    padded_vocab: int
    recompute: formulas.Recompute
    teachers: list[TeacherPlan]


def _activations(run: _Run, raw: dict) -> dict[str, float]:
    layout, chunk_tokens = run.layout, run.config.actor.batching.logprob_chunk_tokens
    kinds = [kind for chunk in raw["layer_kinds"] for kind in chunk]
    flight = formulas.in_flight_microbatches(raw["stages"][0], layout.pp, layout.virtual_stages, run.microbatches)

    def logits(training: bool) -> float:
        return formulas.logits_bytes(run.shape, run.tokens, layout.tp, chunk_tokens, run.padded_vocab,
                                     training=training) if raw["last"] else 0.0

    def train(recompute: formulas.Recompute) -> float:
        saved, transient = formulas.chunk_activation_bytes(run.shape, kinds, run.tokens, layout.tp, layout.expert_tp,
                                                           run.sequence_parallel, recompute)
        return flight * saved + transient + logits(True)

    return dict(none=train(formulas.Recompute()), full=train(formulas.Recompute("full")), configured=train(run.recompute),
                forward=formulas.forward_only_bytes(run.shape, kinds, run.tokens, layout.tp, layout.expert_tp,
                                                    run.sequence_parallel) + logits(False))


def _position(run: _Run, raw: dict) -> Position:
    config, layout, engine = run.config, run.layout, run.engine
    per_stage = layout.world_size // layout.pp
    memory, worst = {}, 0
    for name, role in raw["roles"].items():
        memory[name], index = _role_memory(role)
        worst = index if name == "actor" else worst
    activations = _activations(run, raw)
    colocated = config.rollout.placement == "colocated"
    engine_here = (engine.weights, engine.workspace, engine.kv_cache) if colocated and engine.gpus else (0.0, 0.0, 0.0)
    # The export holds a bucket and the largest tensor it gathers; rank 0 two buckets (one in transit).
    bucket = config.sync.bucket_bytes * (2 if raw["stages"][0] == 0 else 1) + raw["roles"]["actor"]["sync_bytes"]["largest"]
    terms, host = phase_terms(Holdings(
        roles=memory, ref_offloaded=bool(config.needs_reference and config.ref.offload),
        activations=activations["configured"], forward=activations["forward"], engine=engine_here,
        engine_weights=engine.weights, bucket=bucket, receive=2 * config.sync.bucket_bytes,
        reserved=config.plan.reserved_gib * GIB, colocated=colocated,
        # rollout.colocated_offload=never: training state and engine stay resident together in every phase.
        resident=colocated and config.rollout.colocated_offload == "never",
        teacher_resident=sum(t.gpu_bytes for t in run.teachers if t.colocated and not t.offload),
        teacher_offloaded=sum(t.gpu_bytes for t in run.teachers if t.colocated and t.offload)))
    return Position(
        stages=raw["stages"], ranks=_ranges([(s * per_stage, (s + 1) * per_stage - 1) for s in raw["stages"]]),
        layers=_layers_label(raw), worst_rank=raw["stages"][0] * per_stage + worst, roles=memory,
        activations=activations, engine=engine_here[0] + engine_here[1] + max(engine_here[2], 0.0), export_buffer=bucket,
        terms=terms, host_terms=host)


def resolve_run(config):
    """(GPU preset, ModelSpec, ParallelLayout) of the run; a PlanError names the field that cannot work."""
    from rlmega.models import UnsupportedModelError, model_spec_from_hf
    from rlmega.parallel.layout import LayoutError

    if config.model.mtp is False or config.model.mtp == "False":  # YAML reads a bare off as false
        raise PlanError('model.mtp: YAML reads a bare off as false; write "off" in quotes')
    try:
        preset = config.plan.preset()
        spec = model_spec_from_hf(config.model.path, mtp=config.model.mtp)
        layout = config.layout.build()
        spec.check_layout(layout)
    except (UnsupportedModelError, FileNotFoundError, ValueError) as error:
        field = "layout" if isinstance(error, LayoutError) else "plan" if "plan." in str(error) else "model.path"
        raise PlanError(f"{field}: {error}") from None
    return preset, spec, layout


def make_plan(config, config_name: str = "", measure=measure_in_subprocess) -> Plan:
    """The plan of the run ``config`` describes (an ``RLConfig`` loaded without data checks, its choices
    checked: ``rlmega.config.load.check_choices``). ``measure`` builds the ranks (``meta_build``); the layout
    search passes one that reuses builds that candidates share."""
    from rlmega.models import padded_vocab_size

    preset, spec, layout = resolve_run(config)
    roles = _roles(config)
    measured = measure(BuildRequest(spec, layout, roles))["positions"]
    shape = formulas.Shape.of(spec)
    tokens, microbatches = microbatch_tokens(config, layout)
    refit = plan_refit(config, layout, measured, preset, spec, _hf_config(config.model.path))
    engine = engine_plan(config, shape, preset)
    teachers = plan_teachers(config, measure)
    run = _Run(config=config, roles=roles, layout=layout, shape=shape, tokens=tokens, microbatches=microbatches,
               engine=engine, padded_vocab=padded_vocab_size(spec.vocab_size, layout.tp),
               sequence_parallel=config.actor.uses_sequence_parallel(layout.tp, moe=spec.num_experts is not None,
                                                                     gpu=True),  # the plan is for GPUs
               recompute=formulas.Recompute.of(config.actor), teachers=teachers)
    positions = [_position(run, raw) for raw in measured]
    colocated = config.rollout.placement == "colocated"
    plan = Plan(
        config_name=config_name, architecture=spec.architecture, parameters=int(refit.totals["engine_params"]),
        mtp_parameters=int(refit.totals["mtp_params"]), notes=list(spec.notes), layout=layout.describe(),
        gpu=config.plan.gpu, gpu_memory=preset.memory_gib * GIB,
        nodes=math.ceil((layout.world_size + (0 if colocated else engine.gpus) + sum(t.gpus for t in teachers))
                        / config.plan.gpus_per_node),
        tokens_per_microbatch=tokens, microbatches=microbatches, recompute=run.recompute.describe(),
        placement=config.rollout.placement, positions=positions, engine=engine, refit=refit,
        host_per_node=max(p.host for p in positions) * config.plan.gpus_per_node,
        host_memory=config.plan.host_memory_gib * GIB, min_headroom=config.plan.min_headroom_gib * GIB,
        world_size=layout.world_size, ranks_per_stage=layout.world_size // layout.pp,
        pipeline=(layout.pp, layout.virtual_stages), teachers=teachers)
    plan.shortfalls = _shortfalls(plan, config)
    return plan


def _ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in ranges:
        if merged and merged[-1][1] + 1 == first:
            merged[-1] = (merged[-1][0], last)
        else:
            merged.append((first, last))
    return merged


def _shortfalls(plan: Plan, config) -> list[str]:
    """One line per thing that does not fit: the rank, the phase, what it needs and the shortfall."""
    lines = []
    for position in plan.positions:
        phase = position.peak_phase
        need = position.phases[phase]
        short = need + plan.min_headroom - plan.gpu_memory
        if short > 0:
            stage = f"pipeline stage {position.stages[0]} of {config.layout.pp}" if config.layout.pp > 1 else "the only stage"
            lines.append(f"rank {position.worst_rank} ({stage}) needs {need / GIB:.1f} GiB in the {phase} phase, "
                         f"{plan.gpu} has {plan.gpu_memory / GIB:.1f} GiB and {plan.min_headroom / GIB:.1f} GiB must stay "
                         f"free: short by {short / GIB:.1f} GiB ({_biggest(position, phase)})")
    if plan.engine.gpus and plan.engine.kv_cache <= 0:
        lines.append(f"engine GPUs: weights {plan.engine.weights / GIB:.1f} GiB and workspace "
                     f"{plan.engine.workspace / GIB:.1f} GiB exceed rollout.gpu_memory_utilization="
                     f"{config.rollout.gpu_memory_utilization} of {plan.gpu_memory / GIB:.1f} GiB: no room for a KV cache "
                     f"(short by {-plan.engine.kv_cache / GIB:.1f} GiB); raise it or rollout.tensor_parallel_size")
    for teacher in plan.teachers:
        need = teacher.gpu_bytes + config.plan.reserved_gib * GIB
        if not teacher.colocated and need + plan.min_headroom > plan.gpu_memory:
            lines.append(f"{teacher.name} GPUs: its rank needs {need / GIB:.1f} GiB (weights and plan.reserved_gib), "
                         f"{plan.gpu} has {plan.gpu_memory / GIB:.1f} GiB and {plan.min_headroom / GIB:.1f} GiB must stay "
                         f"free; raise {teacher.name}.layout.tp or pp")
    if plan.host_per_node > plan.host_memory:
        lines.append(f"host memory: a node needs {plan.host_per_node / GIB:.0f} GiB, plan.host_memory_gib is "
                     f"{plan.host_memory / GIB:.0f}: short by {(plan.host_per_node - plan.host_memory) / GIB:.0f} GiB")
    return lines


def _biggest(position: Position, phase: str) -> str:
    """The largest parts of a phase, for the shortfall line."""
    parts = {}
    for name, role in position.roles.items():
        parts[f"{name} optimizer"] = role.optimizer_gpu
        parts[f"{name} grads"] = role.grads
        parts[f"{name} params"] = role.params
    if phase in ("generate", "sync"):
        parts["engine"] = position.engine
    parts["teacher"] = sum(term.bytes for term in position.terms[phase] if term.source == "teacher")
    if phase == "update":
        parts["activations"] = position.activations["configured"]
    top = sorted(parts.items(), key=lambda item: -item[1])[:3]
    return ", ".join(f"{name} {value / GIB:.1f}" for name, value in top if value > 0)


def check(plan: Plan, name: Optional[str] = None) -> None:
    """Raise PlanError naming the first shortfall."""
    if plan.shortfalls:
        more = f" (and {len(plan.shortfalls) - 1} more)" if len(plan.shortfalls) > 1 else ""
        raise PlanError(f"{name or plan.config_name}: does not fit: {plan.shortfalls[0]}{more}")

"""``rlmega plan --search``: the Megatron layouts, recomputation, optimizer offload and engine layouts a job can
run with on its GPUs, the ones that fit ranked by the cost model of ``layout_cost``, and the plan of the best.

Three passes, cheapest first. Every combination of the degrees (TP inside a node, CP, PP with even or uneven
stages, VPP, EP and ETP for MoE models), recomputation (none, full), optimizer offload (0, half, all) is
checked against what Megatron allows (``ParallelLayout``, ``ModelSpec.check_layout``); the bound of
``layout_cost`` drops those that cannot fit; the rest are ranked by predicted step time, each with the
colocated engine layout that ranks best beside it, and the planner itself (``make_plan``) decides, in that
order, until ``top`` fit or ``max_plans`` plans were made. The ranks' meta builds depend only on the layout
and the roles' build settings, so candidates that differ in recomputation or engines share one build.
With colocated engines, ``rollout.gpu_memory_utilization`` is lowered (never raised) to what the fullest
GPU's generate and sync phases leave.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import time
from typing import Optional

from rlmega.plan import formulas, layout_cost
from rlmega.plan.meta_build import BuildRequest, PlanBuildError, build_config, measure_in_subprocess
from rlmega.plan.planner import GIB, Plan, PlanError, engine_plan, make_plan, microbatch_tokens, resolve_run

RECOMPUTE = (None, "full")
OFFLOAD = (0.0, 0.5, 1.0)
CP = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: object
    """``ParallelLayout``."""
    recompute: Optional[str]
    offload: float
    engine_tp: int
    """The colocated engines' tensor_parallel_size (0: the engines as configured)."""

    def overrides(self, num_engines: int, utilization: Optional[float]) -> list[str]:
        """The config overrides that select this candidate."""
        layout = self.layout
        values = [f"layout.{name}={_hydra(getattr(layout, name))}" for name in
                  ("tp", "pp", "vpp", "cp", "ep", "etp", "first_stage_layers", "last_stage_layers")]
        values += [f"actor.recompute_granularity={_hydra(self.recompute)}",
                   f"actor.optimizer.cpu_offload_fraction={self.offload:g}"]
        if self.engine_tp:
            values += [f"rollout.tensor_parallel_size={self.engine_tp}", f"rollout.num_engines={num_engines}"]
        if utilization is not None:
            values.append(f"rollout.gpu_memory_utilization={utilization:g}")
        return values

    def describe(self) -> str:
        layout = self.layout
        parts = [f"tp{layout.tp}", f"pp{layout.pp}"]
        if layout.virtual_stages > 1:
            parts.append(f"vpp{layout.vpp}")
        if layout.uneven_stages:
            parts.append(f"({layout.first_stage_layers or '-'}/../{layout.last_stage_layers or '-'})")
        parts += [f"cp{layout.cp}"] if layout.cp > 1 else []
        parts += [f"ep{layout.ep}", f"etp{layout.expert_tp}"] if layout.ep > 1 else []
        parts.append(f"dp{layout.dp}")
        return " ".join(parts)


def _hydra(value) -> str:
    return "null" if value is None else str(value)


@dataclasses.dataclass
class Outcome:
    """A candidate the planner decided on."""

    candidate: Candidate
    overrides: list[str]
    seconds: dict[str, float]
    """The cost model's terms (``layout_cost``), with ``generate``."""
    free: float
    """Bytes left on the fullest GPU in its fullest phase (negative: short)."""
    plan: Optional[Plan]
    reason: str = ""
    """Why it does not fit (the planner's first shortfall), empty when it fits."""

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclasses.dataclass
class SearchResult:
    fitting: list[Outcome]
    """Ranked, cheapest first."""
    rejected: list[Outcome]
    """Planned and found not to fit."""
    enumerated: int
    allowed: int
    """Allowed by Megatron."""
    bounded: list[Candidate]
    """Dropped by the memory bound without a build."""
    within_bound: int
    seconds: float

    @property
    def best(self) -> Optional[Outcome]:
        return self.fitting[0] if self.fitting else None


class _CachedMeasure:
    """``measure_in_subprocess``, once per distinct build: the layout and the roles as the build sees them."""

    def __init__(self):
        self.results: dict[bytes, dict] = {}

    def __call__(self, request: BuildRequest) -> dict:
        key = pickle.dumps((request.spec, request.layout, {name: build_config(config)
                                                           for name, config in request.roles.items()}))
        if key not in self.results:
            self.results[key] = measure_in_subprocess(request)
        return self.results[key]


def apply(config, candidate: Candidate, num_engines: int = 0, utilization: Optional[float] = None):
    """A copy of ``config`` with ``candidate``'s settings."""
    config = copy.deepcopy(config)
    for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "first_stage_layers", "last_stage_layers"):
        setattr(config.layout, name, getattr(candidate.layout, name))
    for role in [config.actor] + ([config.critic] if config.needs_critic else []):
        role.recompute_granularity = candidate.recompute
        role.recompute_method = role.recompute_num_layers = role.recompute_modules = None
        role.optimizer.cpu_offload_fraction = candidate.offload
    if candidate.engine_tp:
        config.rollout.tensor_parallel_size, config.rollout.num_engines = candidate.engine_tp, num_engines
    if utilization is not None:
        config.rollout.gpu_memory_utilization = utilization
    return config


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def _layouts(spec, world: int, gpus_per_node: int):
    """Every layout Megatron allows for ``spec`` on ``world`` ranks, TP and TP x CP inside a node."""
    from rlmega.parallel.layout import LayoutError, ParallelLayout, uneven_stage_options

    layers, experts = spec.num_layers, spec.num_experts
    for tp in [d for d in _divisors(gpus_per_node)]:
        for cp in [c for c in CP if tp * c <= gpus_per_node]:
            if world % (tp * cp):
                continue
            for pp in [p for p in _divisors(world // (tp * cp)) if p <= layers]:
                splits = [dict(vpp=None)]
                if pp > 1 and layers % pp == 0 and layers % (2 * pp) == 0:
                    splits.append(dict(vpp=2))
                if pp > 1 and layers % pp:
                    splits = [dict(first_stage_layers=first, last_stage_layers=last)
                              for first, last, _ in uneven_stage_options(layers, pp)[:2]]
                for split in splits:
                    for ep in ([1] + [e for e in _divisors(experts) if e > 1] if experts else [1]):
                        try:
                            layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, world_size=world, **split)
                            spec.check_layout(layout)
                        except LayoutError:
                            continue
                        yield layout


def _job(config, spec, preset) -> layout_cost.Job:
    pattern = spec.config.get("moe_layer_freq")
    kinds = tuple("moe" if (pattern[i] if isinstance(pattern, list) else spec.num_experts) else "dense"
                  for i in range(spec.num_layers))
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    trained = 1 + bool(config.needs_critic)
    return layout_cost.Job(
        shape=formulas.Shape.of(spec), layer_kinds=kinds, tied=spec.tie_word_embeddings,
        train_tokens=config.trainer.prompts_per_step * config.rollout.n * longest,
        forward_passes=1 + bool(config.needs_reference), optimizer_steps=config.actor.ppo_mini_batches,
        trained_roles=trained, resident_roles=int(bool(config.builds_reference_model and not config.ref.offload)),
        max_new_tokens=config.rollout.max_new_tokens, gpus_per_node=config.plan.gpus_per_node,
        ib_gb_per_s=config.plan.ib_gb_per_s, gpu_memory=preset.memory_gib * GIB,
        headroom=config.plan.min_headroom_gib * GIB, reserved=config.plan.reserved_gib * GIB,
        bf16_tflops=preset.bf16_tflops, hbm_tb_per_s=preset.hbm_tb_per_s, nvlink_gb_per_s=preset.nvlink_gb_per_s)


def _engine_options(config, spec, preset, job) -> dict[int, tuple[int, float]]:
    """{engine tensor_parallel_size: (engines, predicted generation seconds)} of colocated engines that can
    hold the model; {0: as configured} when the engines are not colocated."""
    rollout = config.rollout
    shape = formulas.Shape.of(spec)
    if rollout.placement != "colocated" or rollout.backend == "hf":
        return {0: (rollout.num_engines, 0.0)}
    world, replicas = config.layout.world_size, rollout.data_parallel_size
    options = {}
    for tp in _divisors(world // replicas if world % replicas == 0 else 1):
        if shape.heads % tp or (spec.num_experts and rollout.expert_parallel_size > 1 and spec.num_experts % (tp * replicas)):
            continue
        trial = copy.deepcopy(config)
        trial.rollout.tensor_parallel_size, trial.rollout.num_engines = tp, world // (tp * replicas)
        engine = engine_plan(trial, shape, preset)
        if engine.kv_cache > 0:
            options[tp] = (trial.rollout.num_engines,
                           layout_cost.generation_seconds(job, engine.weights, engine.kv_tokens, engine.tokens_needed))
    return options


def _fits_bound(job, config, spec, layout, recompute: Optional[str], offload: float) -> bool:
    from rlmega.models import padded_vocab_size

    tokens, microbatches = microbatch_tokens(config, layout)
    sequence_parallel = config.actor.uses_sequence_parallel(layout.tp, moe=spec.num_experts is not None, gpu=True)
    need = layout_cost.update_lower_bound(
        job, layout, formulas.Recompute(recompute), offload, tokens, microbatches, sequence_parallel,
        padded_vocab_size(spec.vocab_size, layout.tp), config.actor.batching.logprob_chunk_tokens)
    return need + job.headroom <= job.gpu_memory


def _fitted_utilization(plan: Plan, config) -> float:
    """The largest ``gpu_memory_utilization`` (hundredths, at most the configured) at which the fullest GPU's
    generate and sync phases keep the headroom: the engine's share is the only term they gain from it."""
    slack = min(plan.gpu_memory - plan.min_headroom - max(p.phases["generate"], p.phases["sync"])
                for p in plan.positions)
    fitted = config.rollout.gpu_memory_utilization + slack / plan.gpu_memory
    return min(config.rollout.gpu_memory_utilization, math.floor(fitted * 100) / 100)


def search(config, config_name: str = "", top: int = 3, max_plans: int = 12) -> SearchResult:
    """The layouts of ``config``'s job (model, GPUs, lengths, batch, algorithm) that fit, ranked by the cost model;
    the planner decides on at most ``max_plans`` candidates, stopping at ``top`` that fit."""
    started = time.monotonic()
    from rlmega.parallel.layout import ParallelLayout

    # The configured layout need not suit the model: the model and the GPU are what the search reads.
    preset, spec, _ = resolve_run(apply(config, Candidate(ParallelLayout(world_size=config.layout.world_size), None,
                                                          0.0, 0)))
    job = _job(config, spec, preset)
    world = config.layout.world_size
    engines = _engine_options(config, spec, preset, job)
    if not engines:
        raise PlanError(f"rollout: no colocated engine layout of {world} GPUs leaves room for a KV cache at "
                        f"rollout.gpu_memory_utilization={config.rollout.gpu_memory_utilization}; raise it")
    enumerated = allowed = 0
    ranked, bounded = [], []
    for layout in _layouts(spec, world, config.plan.gpus_per_node):
        allowed += 1
        for recompute in RECOMPUTE:
            for offload in OFFLOAD:
                enumerated += 1
                candidate = Candidate(layout, recompute, offload, 0)
                if not _fits_bound(job, config, spec, layout, recompute, offload):
                    bounded.append(candidate)
                    continue
                _, microbatches = microbatch_tokens(config, layout)
                ranked.append((sum(layout_cost.training_seconds(job, layout, recompute == "full", offload,
                                                                microbatches).values()), candidate))
    ranked.sort(key=lambda item: item[0])
    engine_order = sorted(engines.items(), key=lambda item: item[1][1])
    # The engines' cost does not depend on the training layout: each candidate goes with the cheapest engines
    # first, then the next engine layout once every candidate has had its first.
    queue = [dataclasses.replace(candidate, engine_tp=tp) for tp, _ in engine_order for _, candidate in ranked]
    measure = _CachedMeasure()
    fitting, rejected = [], []
    for candidate in queue:
        if len(fitting) >= top or len(fitting) + len(rejected) >= max_plans:
            break
        outcome = _decide(config, config_name, candidate, engines, job, measure)
        (rejected if outcome.reason else fitting).append(outcome)
    fitting.sort(key=lambda outcome: outcome.total)
    return SearchResult(fitting=fitting, rejected=rejected, enumerated=enumerated, allowed=allowed,
                        bounded=bounded, within_bound=len(ranked), seconds=time.monotonic() - started)


def _decide(config, config_name, candidate: Candidate, engines, job, measure) -> Outcome:
    """The planner's verdict on ``candidate``, with the engines' memory share fitted when they are colocated."""
    from rlmega.errors import UserError

    num_engines = engines[candidate.engine_tp][0]
    trial = apply(config, candidate, num_engines)
    _, microbatches = microbatch_tokens(trial, candidate.layout)
    seconds = layout_cost.training_seconds(job, candidate.layout, candidate.recompute == "full", candidate.offload,
                                           microbatches)
    utilization = None
    try:
        plan = make_plan(trial, config_name, measure=measure)
        if config.rollout.placement == "colocated":
            utilization = _fitted_utilization(plan, trial)
            if utilization != trial.rollout.gpu_memory_utilization and utilization > 0:
                trial = apply(config, candidate, num_engines, utilization)
                plan = make_plan(trial, config_name, measure=measure)
    except (UserError, PlanBuildError) as error:
        return Outcome(candidate, candidate.overrides(num_engines, utilization), seconds, -math.inf, None,
                       reason=" ".join(str(error).split()))
    engine = plan.engine
    seconds["generate"] = (layout_cost.generation_seconds(job, engine.weights, engine.kv_tokens, engine.tokens_needed)
                           if engine.gpus else 0.0)
    free = min(plan.gpu_memory - p.phases[p.peak_phase] for p in plan.positions)
    return Outcome(candidate, candidate.overrides(num_engines, utilization), seconds, free, plan,
                   reason=plan.shortfalls[0] if plan.shortfalls else "")


TERMS = ("generate", "compute", "recompute", "bubble", "tp", "cp", "ep", "offload")


def _row(outcome: Outcome) -> str:
    candidate = outcome.candidate
    engines = "as configured" if not candidate.engine_tp else f"TP{candidate.engine_tp}"
    terms = " ".join(f"{outcome.seconds.get(term, 0.0):>7.1f}" for term in TERMS)
    return (f"  {candidate.describe():<34} {candidate.recompute or 'none':<6} {candidate.offload:>4g} {engines:>6} "
            f"{outcome.total:>8.1f} {terms} {outcome.free / GIB:>6.1f}")


def render_search(result: SearchResult) -> str:
    """The ranked layouts that fit, the planned ones that do not, and how the best is chosen."""
    header = (f"  {'layout':<34} {'recomp':<6} {'offl':>4} {'engine':>6} {'step s':>8} "
              + " ".join(f"{term:>7}" for term in TERMS) + f" {'free':>6}")
    lines = [f"search     {result.allowed} layouts Megatron allows x recomputation x optimizer offload = "
             f"{result.enumerated} candidates; {len(result.bounded)} cannot fit by the memory bound, "
             f"{result.within_bound} ranked by predicted step time; the planner built "
             f"{len(result.fitting) + len(result.rejected)} ({result.seconds:.0f} s)",
             "", "fit, cheapest first (predicted seconds of one step, rlmega/plan/README.md; free GiB on the fullest GPU):",
             header]
    lines += [_row(outcome) for outcome in result.fitting] or ["  none"]
    if result.rejected:
        lines += ["", "planned and refused:"]
        lines += [f"  {o.candidate.describe()} recompute {o.candidate.recompute or 'none'}, offload "
                  f"{o.candidate.offload:g}: {o.reason}" for o in result.rejected]
    best = result.best
    if best is not None:
        lines += ["", f"best       {best.candidate.describe()}: {why_best(result)}",
                  f"overrides  {' '.join(best.overrides)}"]
    return "\n".join(lines)


def why_best(result: SearchResult) -> str:
    """One sentence: what the best layout costs and what it wins over the next."""
    best = result.best
    terms = sorted(((value, term) for term, value in best.seconds.items() if value), reverse=True)[:3]
    said = ", ".join(f"{term} {value:.0f} s" for value, term in terms)
    text = (f"fits with {best.free / GIB:.1f} GiB free and the lowest predicted step time of those that fit, "
            f"{best.total:.0f} s ({said})")
    if len(result.fitting) > 1:
        runner = result.fitting[1]
        text += f"; next: {runner.candidate.describe()} at {runner.total:.0f} s"
    return text

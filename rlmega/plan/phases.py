"""What a training rank's GPU holds in each phase of a step, and its host, term by term, each term with
where its bytes come from. A phase's total is the sum of its terms, so what ``rlmega plan --explain``
lists is what the verdict adds up.
"""

from __future__ import annotations

import dataclasses

PHASES = ("generate", "logprobs", "update", "sync")

SOURCES = {
    "params": "measured: the bf16 parameter buffer Megatron's DDP allocates for this rank, padding included, and the "
              "parameters outside it, on the meta device (meta_build)",
    "buffers": "measured: the modules' registered buffers (RoPE frequencies, router bias), on the meta device (meta_build)",
    "grads": "measured: DDP's fp32 gradient buffers, on the meta device (meta_build)",
    "optimizer_gpu": "measured: the worker's optimizer built and stepped once on this rank under simulated_gpu, "
                     "its storages a GPU keeps (meta_build, placement)",
    "optimizer_host": "measured: the same optimizer's storages in host memory (meta_build, placement)",
    "reserved": "config: plan.reserved_gib (CUDA contexts, NCCL buffers, fragmentation)",
    "activations": "formula: activations each layer saves x the stage's micro-batches in flight under 1F1B, plus the "
                   "last stage's logits (formulas.chunk_activation_bytes, after Korthikanti et al. 2022)",
    "forward": "formula: one layer's activations of a forward pass, plus the last stage's logits chunk "
               "(formulas.forward_only_bytes)",
    "engine_weights": "layout: the HF tensors as vLLM shards them over the engine's ranks, the fullest rank "
                      "(rollout.engine_bytes)",
    "engine_workspace": "config: plan.engine_workspace_gib",
    "kv_cache": "formula: rollout.gpu_memory_utilization x GPU memory - engine weights - workspace",
    "bucket": "config: sync.bucket_bytes, two on stage 0 (one in transit), plus measured: the largest tensor the "
              "rank gathers for the export (meta_build)",
    "receive": "config: 2 x sync.bucket_bytes, the woken engine's receive slots",
    "teacher": "measured: a distillation teacher's parameters and buffers on its fullest rank (teacher.layout, "
               "teacher.dtype) x its ranks on this GPU (teacher.gpus_per_rank < 1: the actor's GPUs), on the meta "
               "device (meta_build, plan/teacher.py)",
    "swapped": "the larger of the trained roles (offloaded while the engine generates) and the engine's weights "
               "(asleep while the roles train)",
}


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    source: str
    """A key of ``SOURCES``."""


def _role_terms(name: str, memory, with_training_state: bool = True) -> list[Term]:
    terms = [Term(f"{name} parameters", memory.params, "params"), Term(f"{name} module buffers", memory.buffers, "buffers")]
    if with_training_state:
        terms += [Term(f"{name} gradients", memory.grads, "grads"),
                  Term(f"{name} optimizer on GPU", memory.optimizer_gpu, "optimizer_gpu")]
    return [term for term in terms if term.bytes or term.source == "optimizer_gpu"]  # 0 on the GPU says offloaded


@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one position's phases are made of (bytes)."""

    roles: dict
    """{role: ``RoleMemory``}."""
    ref_offloaded: bool
    activations: float
    forward: float
    engine: tuple[float, float, float]
    """(weights, workspace, KV cache) of the colocated engine on this GPU; zeros when disaggregated."""
    engine_weights: float
    """Per engine GPU, colocated or not (what sleeps in host memory)."""
    bucket: float
    receive: float
    reserved: float
    colocated: bool
    resident: bool
    """rollout.colocated_offload=never: training state and engine stay on the GPU together."""
    teacher_resident: float = 0.0
    """Distillation teachers' weights on this GPU that stay there (``teacher.offload`` false)."""
    teacher_offloaded: float = 0.0
    """Those onloaded for the log-prob phase only (``teacher.offload``), in host memory otherwise."""


def phase_terms(held: Holdings) -> tuple[dict[str, list[Term]], list[Term]]:
    """({phase: GPU terms}, host terms) of one position (the trainer's phases: planner's docstring)."""
    trained = [t for name, memory in held.roles.items() if name != "ref" for t in _role_terms(name, memory)]
    # Handing the GPU over, the trainer frees the gradients and moves the optimizer to host before the engines
    # wake for a sync (MegatronWorker.release_training_state): the export reads the parameters alone. The host
    # holds that state then, less than it holds while the engines generate (the "swapped" term).
    hands_over = held.colocated and not held.resident
    exported = [t for name, memory in held.roles.items() if name != "ref"
                for t in _role_terms(name, memory, with_training_state=False)]
    ref = held.roles.get("ref")
    ref_gpu = _role_terms("ref", ref, with_training_state=False) if ref else []
    ref_rest = [] if held.ref_offloaded else ref_gpu
    weights, workspace, kv = held.engine
    engine = [t for t in (Term("engine weights", weights, "engine_weights"),
                          Term("engine workspace", workspace, "engine_workspace"),
                          Term("engine KV cache", max(kv, 0.0), "kv_cache")) if t.bytes]
    resident = engine if held.resident else []
    reserved = [Term("reserved", held.reserved, "reserved")]
    teacher = [Term("teacher parameters", held.teacher_resident, "teacher")] if held.teacher_resident else []
    scoring = teacher + ([Term("teacher parameters (onloaded)", held.teacher_offloaded, "teacher")]
                         if held.teacher_offloaded else [])
    gpu = {
        "generate": reserved + teacher + ref_rest + ((engine + (trained if resident else [])) if held.colocated else trained),
        "logprobs": reserved + scoring + trained + ref_gpu
                    + [Term("activations, forward only", held.forward, "forward")] + resident,
        "update": reserved + teacher + trained + ref_rest
                  + [Term("activations, as configured", held.activations, "activations")] + resident,
        "sync": reserved + teacher + (exported if hands_over else trained) + ref_rest
                + [Term("sync buckets", held.bucket, "bucket")]
                + (engine + [Term("engine receive slots", held.receive, "receive")] if engine else []),
    }
    host = [Term(f"{name} optimizer in host memory", memory.optimizer_host, "optimizer_host")
            for name, memory in held.roles.items() if memory.optimizer_host]
    if ref and held.ref_offloaded:
        host += [Term(f"{t.name} (offloaded)", t.bytes, t.source) for t in ref_gpu]
    if held.teacher_offloaded:
        host.append(Term("teacher parameters (offloaded)", held.teacher_offloaded, "teacher"))
    if held.colocated and not held.resident:
        host.append(Term("trained roles or sleeping engine", max(sum(t.bytes for t in trained), held.engine_weights),
                         "swapped"))
    return gpu, host

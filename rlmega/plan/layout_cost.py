"""What the layout search computes without building anything: a lower bound on a training rank's memory in the
update phase (to drop layouts that cannot fit before the planner builds them) and the cost model that ranks
layouts (predicted seconds of one RL step, for ranking only).

The bound counts, per pipeline stage, the weights of the layers the stage builds split as Megatron splits them
(attention and MLPs over TP, experts over EP x ETP, the embedding and LM head over TP), and leaves out what
only adds (norms, biases, padding, module buffers): bf16 parameters, fp32 gradients and, with the optimizer on
the GPU, Adam's 12 bytes per element of the rank's distributed-optimizer shard. Activations are the planner's
own formulas (``formulas``). A layout is dropped only when that bound already leaves less than
``plan.min_headroom_gib`` free.

The cost model (stated in ``rlmega/plan/README.md``) adds, in seconds of one step:

- compute: ``2 x active parameters x tokens`` per forward pass over the world's GPUs at ``MFU`` of the GPU's
  bf16 peak; training is three passes, full recomputation one more, each log-prob pass (actor, reference) one;
- the pipeline bubble: the trainer's compute x ``b / (1 - b)`` with ``b = (pp - 1) / (vpp x m + pp - 1)``;
- tensor parallelism: 4 all-gathers / reduce-scatters of the hidden state per layer and forward pass
  (sequence parallel), twice that for a backward pass, ``(tp - 1) / tp`` of them over NVLink within a node
  (over the GPU's share of InfiniBand beyond);
- context parallelism: the ring passes each rank's K and V to the ``cp - 1`` others per layer and pass (the
  backward pass also their gradients);
- expert parallelism: each MoE layer's dispatch and combine all-to-alls, ``top-k`` copies of a token's hidden
  state, ``(ep - 1) / ep`` of them leaving the GPU;
- optimizer offload: the offloaded share's gradients down and parameters up over PCIe, and its Adam step in host
  memory, once per optimizer step;
- generation: every engine decodes ``rollout.max_new_tokens`` steps per wave of sequences its KV cache holds,
  each step reading the engine GPU's weights once (memory-bound decoding).

Not modelled: data-parallel gradient reduction (overlapped with the backward pass), pipeline send/receive,
attention's quadratic term, prefill, load imbalance.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from rlmega.plan import formulas

GIB = 1024**3
MFU = 0.4
"""Share of the bf16 peak a training pass achieves (an assumption)."""
PCIE_GB_PER_S = 25.0
"""One GPU's host link, one direction (an assumption: PCIe Gen5 x16 in practice)."""
HOST_ADAM_GB_PER_S = 20.0
"""Host memory traffic of one GPU's CPU Adam step (an assumption: 32 bytes read and written per element)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What the cost model and the bound read of a run, resolved once."""

    shape: formulas.Shape
    layer_kinds: tuple[str, ...]
    """"dense" or "moe" per layer."""
    tied: bool
    train_tokens: int
    """Tokens of one step's sequences at full length (prompt and response)."""
    forward_passes: int
    """Log-prob passes per step: the actor's old log-probs, and the reference's."""
    optimizer_steps: int
    trained_roles: int
    """Roles with gradients and an optimizer (actor, critic)."""
    resident_roles: int
    """Roles whose parameters stay on the GPU through the update (a reference not offloaded)."""
    max_new_tokens: int
    gpus_per_node: int
    ib_gb_per_s: float
    gpu_memory: float
    headroom: float
    reserved: float
    bf16_tflops: float
    hbm_tb_per_s: float
    nvlink_gb_per_s: float


def layer_params(shape: formulas.Shape, kind: str, tp: int, ep: int, etp: int) -> int:
    """Weight elements of one layer on one rank (norms and biases left out)."""
    h = shape.hidden
    if shape.mla:
        qr, kvr, dn, dr, dv = shape.mla
        n = shape.heads
        q = h * qr + qr * n * (dn + dr) if qr else h * n * (dn + dr)
        attention = q + h * (kvr + dr) + kvr * n * (dn + dv) + n * dv * h
    else:
        attention = 2 * h * shape.heads * shape.head_dim + 2 * h * shape.kv_heads * shape.head_dim
    if kind == "dense":
        return (attention + 3 * h * shape.ffn) // tp
    experts = shape.experts * 3 * h * shape.expert_ffn // (ep * etp)
    return attention // tp + experts + 3 * h * shape.shared_ffn // tp + h * shape.experts


def active_params_per_token(job: Job) -> int:
    """Weight elements one token passes through (MoE: its top-k experts), with the LM head."""
    shape, total = job.shape, job.shape.vocab * job.shape.hidden
    for kind in job.layer_kinds:
        if kind == "dense":
            total += layer_params(shape, "dense", 1, 1, 1)
        else:
            routed = shape.experts * 3 * shape.hidden * shape.expert_ffn
            total += layer_params(shape, "moe", 1, 1, 1) - routed + shape.topk * 3 * shape.hidden * shape.expert_ffn
    return total


def stage_layer_counts(num_layers: int, layout) -> list[int]:
    """Layers of each pipeline stage (all its virtual chunks together)."""
    if not layout.uneven_stages:
        return [num_layers // layout.pp] * layout.pp
    first, last = layout.first_stage_layers, layout.last_stage_layers
    inner = layout.pp - (first is not None) - (last is not None)
    middle = (num_layers - (first or 0) - (last or 0)) // inner if inner else 0
    return [first if first is not None else middle] + [middle] * (layout.pp - 2) + [last if last is not None else middle]


def update_lower_bound(job: Job, layout, recompute: formulas.Recompute, offload: float, tokens: int,
                       microbatches: int, sequence_parallel: bool, padded_vocab: int, chunk_tokens: int) -> float:
    """A lower bound on the fullest rank's update phase (bytes), over the stages that differ."""
    counts = stage_layer_counts(len(job.layer_kinds), layout)
    starts = [sum(counts[:stage]) for stage in range(layout.pp)]
    distinct = {0, layout.pp - 1, layout.pp // 2, 1 % layout.pp}
    worst = 0.0
    for stage in distinct:
        kinds = list(job.layer_kinds[starts[stage]:starts[stage] + counts[stage]])
        dense = sum(layer_params(job.shape, kind, layout.tp, layout.ep, layout.expert_tp) for kind in kinds
                    if kind == "dense")
        moe = [layer_params(job.shape, kind, layout.tp, layout.ep, layout.expert_tp) for kind in kinds if kind == "moe"]
        routed = job.shape.experts * 3 * job.shape.hidden * job.shape.expert_ffn // (layout.ep * layout.expert_tp)
        expert = routed * len(moe)
        dense += sum(moe) - expert
        vocab_rows = padded_vocab * job.shape.hidden // layout.tp
        dense += vocab_rows * ((stage == 0) + (stage == layout.pp - 1 and not (job.tied and layout.pp == 1)))
        elements = dense + expert
        owned = dense / (layout.dp * layout.cp) + expert / layout.expert_dp
        state = 2 * elements + 4 * elements + (12 * owned if not offload else 0.0)
        flight = formulas.in_flight_microbatches(stage, layout.pp, layout.virtual_stages, microbatches)
        saved, transient = _chunk_activations(job.shape, tuple(kinds), tokens, layout.tp, layout.expert_tp,
                                              sequence_parallel, recompute)
        logits = formulas.logits_bytes(job.shape, tokens, layout.tp, chunk_tokens, padded_vocab, training=True) \
            if stage == layout.pp - 1 else 0.0
        worst = max(worst, job.reserved + job.trained_roles * state + job.resident_roles * 2 * elements
                    + flight * saved + transient + logits)
    return worst


@functools.lru_cache(maxsize=4096)
def _chunk_activations(shape, kinds: tuple, tokens, tp, etp, sequence_parallel, recompute) -> tuple[float, float]:
    """``formulas.chunk_activation_bytes``, once per distinct stage (a search asks for the same ones often)."""
    return formulas.chunk_activation_bytes(shape, list(kinds), tokens, tp, etp, sequence_parallel, recompute)


def owned_elements(job: Job, layout) -> float:
    """Elements of an average rank's optimizer shard (for the offload's cost)."""
    total = sum(layer_params(job.shape, kind, layout.tp, layout.ep, layout.expert_tp) for kind in job.layer_kinds)
    return total / (layout.pp * layout.dp * layout.cp)


def _link(span: int, job: Job) -> float:
    """GB/s of a group of ``span`` consecutive ranks: NVLink inside a node, a NIC's share beyond."""
    return job.nvlink_gb_per_s if span <= job.gpus_per_node else job.ib_gb_per_s / job.gpus_per_node


def training_seconds(job: Job, layout, recompute: bool, offload: float, microbatches: int) -> dict[str, float]:
    """{term: seconds} of the trainer's share of one step under ``layout``."""
    world, shape = layout.world_size, job.shape
    forward = 2 * active_params_per_token(job) * job.train_tokens / (world * job.bf16_tflops * 1e12 * MFU)
    passes = {"train": 3.0, "recompute": 1.0 if recompute else 0.0, "logprobs": float(job.forward_passes)}
    compute = {name: forward * count for name, count in passes.items()}
    bubble_share = (layout.pp - 1) / (layout.virtual_stages * microbatches + layout.pp - 1)
    forward_equivalents = 2 + passes["recompute"] + passes["logprobs"]  # a backward pass moves twice a forward's
    rank_tokens = job.train_tokens / (layout.dp * layout.cp)
    layers = len(job.layer_kinds) / layout.pp
    moe_layers = job.layer_kinds.count("moe") / layout.pp
    tp_bytes = 4 * 2 * shape.hidden * (layout.tp - 1) / layout.tp * rank_tokens * layers * forward_equivalents
    # K and V of a token, bf16, on one TP rank (MLA: its heads' expanded keys and values).
    kv = 2 * (shape.heads * sum(shape.mla[2:]) if shape.mla else 2 * shape.kv_heads * shape.head_dim) / layout.tp
    cp_bytes = (layout.cp - 1) * kv * rank_tokens * layers * forward_equivalents
    ep_bytes = (2 * shape.topk * 2 * shape.hidden * (layout.ep - 1) / layout.ep * rank_tokens / layout.tp * moe_layers
                * forward_equivalents)
    owned = owned_elements(job, layout) * offload
    return dict(
        compute=compute["train"] + compute["logprobs"],
        recompute=compute["recompute"],
        bubble=sum(compute.values()) * bubble_share / (1 - bubble_share),
        tp=tp_bytes / (_link(layout.tp, job) * 1e9),
        cp=cp_bytes / (_link(layout.tp * layout.cp, job) * 1e9),
        ep=ep_bytes / (_link(layout.ep * layout.expert_tp, job) * 1e9),
        offload=job.optimizer_steps * owned * (6 / (PCIE_GB_PER_S * 1e9) + 32 / (HOST_ADAM_GB_PER_S * 1e9)),
    )


def generation_seconds(job: Job, weights_per_gpu: float, kv_tokens: int, tokens_needed: int) -> float:
    """Decoding time of one step: ``max_new_tokens`` steps per wave, each reading the GPU's weights once."""
    if kv_tokens <= 0:
        return math.inf
    waves = max(1, math.ceil(tokens_needed / kv_tokens))
    return job.max_new_tokens * waves * weights_per_gpu / (job.hbm_tb_per_s * 1e12)

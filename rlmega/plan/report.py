"""A plan as a table a person reads (``render``); ``Plan.to_json`` is the machine-readable form."""

from __future__ import annotations

from rlmega.plan.planner import GIB, Plan

LABEL = 34


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def _row(label: str, cells: list[str]) -> str:
    return f"  {label:<{LABEL}}" + "".join(f"{cell:>16}" for cell in cells)


def stages_label(stages: list[int]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}" \
        if stages == list(range(stages[0], stages[-1] + 1)) else f"{len(stages)} stages"


def _sliced(sliced) -> list[str]:
    """A sliced transfer's bytes per link and its slowest GPU (``rlmega.plan.sliced_refit``)."""
    links = ", ".join(f"{name} {sliced.link_bytes[link] / 1e9:.1f} GB" for link, name in
                      (("network", "network"), ("nvlink", "NVLink"), ("self", "on the GPU")))
    slowest = sliced.slowest
    if slowest is None:
        return [f"  {sliced.label}: nothing to send"]
    return [f"  {sliced.label}: {links}; {sum(sliced.link_messages.values()):,} messages",
            f"  predicted {sliced.seconds:.2f} s: GPU {slowest.gpu}, bound by {slowest.bound}, "
            f"{max(slowest.sent['network'], slowest.received['network']) / 1e9:.1f} GB over its NIC, "
            f"{max(slowest.sent['nvlink'], slowest.received['nvlink']) / 1e9:.1f} GB over NVLink, "
            f"{slowest.messages:,} messages x {sliced.message_latency_s * 1e6:g} us"]


def render(plan: Plan) -> str:
    positions = plan.positions
    lines = [
        f"rlmega plan {plan.config_name}",
        f"model      {plan.architecture}: {plan.parameters / 1e9:.2f} B parameters"
        + (f" + {plan.mtp_parameters / 1e9:.2f} B in MTP layers" if plan.mtp_parameters else "") + ", bf16",
    ]
    lines += [f"note       {note}" for note in plan.notes]
    lines += [
        f"layout     {plan.layout}, {plan.nodes} node(s) of {plan.gpu} ({plan.gpu_memory / GIB:.1f} GiB)",
        f"batches    {plan.tokens_per_microbatch} tokens per micro-batch, {plan.microbatches} micro-batch(es) per "
        f"mini-batch per rank, recompute {plan.recompute}",
        f"pipeline   bubble {plan.bubble:.1%} of a mini-batch's time, (pp - 1) / (vpp x m + pp - 1) with "
        f"m = {plan.microbatches} micro-batches",
        "",
        "GiB per GPU (each position's rank with the largest optimizer shard; parameters and gradients are",
        "the same on every rank of a stage)",
        _row("", [stages_label(p.stages) for p in positions]),
        _row("ranks", [",".join(f"{a}-{b}" if a != b else str(a) for a, b in p.ranks) for p in positions]),
        _row("layers", [p.layers for p in positions]),
    ]
    for role in positions[0].roles:
        memories = [p.roles[role] for p in positions]
        lines.append(_row(f"{role} parameters (bf16)", [_gib(m.params + m.buffers) for m in memories]))
        if any(m.grads for m in memories):
            lines.append(_row(f"{role} gradients (fp32 buffer)", [_gib(m.grads) for m in memories]))
            lines.append(_row(f"{role} optimizer on GPU", [_gib(m.optimizer_gpu) for m in memories]))
            if any(m.optimizer_host for m in memories):
                lines.append(_row(f"{role} optimizer in host memory", [_gib(m.optimizer_host) for m in memories]))
            for variant in memories[0].optimizer_variants:
                where = "host" if variant == "cpu_offload" else "GPU"
                lines.append(_row(f"  as {variant} ({where})", [_gib(m.optimizer_variants[variant]) for m in memories]))
    colocated = [t for t in plan.teachers if t.colocated]
    if colocated:
        label = "teacher parameters" + (" (offloaded)" if all(t.offload for t in colocated) else "")
        lines.append(_row(label, [_gib(sum(t.gpu_bytes for t in colocated))] * len(positions)))
    lines += [
        _row("activations, no recompute", [_gib(p.activations["none"]) for p in positions]),
        _row("activations, full recompute", [_gib(p.activations["full"]) for p in positions]),
        _row("activations, as configured", [_gib(p.activations["configured"]) for p in positions]),
        _row("activations, forward only", [_gib(p.activations["forward"]) for p in positions]),
        _row("sync buckets", [_gib(p.export_buffer) for p in positions]),
    ]
    if plan.placement == "colocated":
        lines.append(_row("colocated engine share", [_gib(p.engine) for p in positions]))
    for phase in ("generate", "logprobs", "update", "sync"):
        lines.append(_row(f"phase {phase}", [_gib(p.phases[phase]) for p in positions]))
    lines.append(_row("peak (phase)", [f"{_gib(p.phases[p.peak_phase])} {p.peak_phase}" for p in positions]))
    lines.append(_row(f"free of {plan.gpu_memory / GIB:.1f}", [_gib(plan.gpu_memory - p.phases[p.peak_phase]) for p in positions]))
    lines.append(_row("host memory per GPU", [_gib(p.host) for p in positions]))
    engine = plan.engine
    lines += [
        "",
        f"engines    {engine.gpus} GPUs ({plan.placement}): weights {_gib(engine.weights)} GiB"
        f"{' in fp8' if engine.weight_dtype == 'fp8' else ''}, workspace "
        f"{_gib(engine.workspace)} GiB, KV cache {_gib(engine.kv_cache)} GiB per GPU = {engine.kv_tokens:,} tokens "
        f"per replica ({engine.kv_bytes_per_token / 1024:.1f} KiB per token); a step needs {engine.tokens_needed:,} "
        f"at full length" + ("" if engine.kv_tokens >= engine.tokens_needed else
                              f": the engine runs about {engine.kv_tokens / max(engine.tokens_needed, 1):.0%} of them at once"),
        f"host       {plan.host_per_node / GIB:.0f} GiB per node of {plan.host_memory / GIB:.0f}",
    ]
    for teacher in plan.teachers:
        where = (f"sharing the actor's GPUs ({teacher.ranks_per_gpu} per GPU)" if teacher.colocated
                 else f"on {teacher.gpus} GPUs of its own")
        rest = ", in host memory between uses (offload)" if teacher.offload else ", resident"
        lines.append(f"teacher    {teacher.name}: {teacher.layout}, {teacher.world_size} ranks {where}: "
                     f"{_gib(teacher.rank_bytes)} GiB of {teacher.dtype} weights per rank{rest}")
    refit = plan.refit
    chosen = refit.transport + (" (auto)" if refit.requested == "auto" else "")
    if refit.sliced is not None:
        lines += ["", f"refit      transport {chosen}: each engine GPU pulls only the blocks it holds from the owners"]
        lines += _sliced(refit.sliced)
    elif refit.adapters_only:
        lines += ["", f"refit      {refit.bytes_per_sync / 1e6:.1f} MB per sync to every engine GPU, adapters only "
                      f"(sync.lora=adapters), transport {chosen}"]
    else:
        lines += ["", f"refit      {refit.bytes_per_sync / 1e9:.1f} GB per sync to every engine GPU, transport {chosen}"]
    # Adapters are megabytes: in MB, with the seconds to match.
    unit, scale, digits = ("MB", 1e6, 3) if refit.adapters_only else ("GB", 1e9, 1)
    for row in refit.senders if refit.sliced is None else ():
        if row["bytes_each"]:
            link = {"nvlink": "NVLink", "ib": "InfiniBand"}.get(row["link"])
            where = "hold it (rank 0)" if row["link"] == "self" else f"send it over {link} to rank 0"
            lines.append(f"  {stages_label(row['stages'])}: {row['count']} rank(s) own {row['bytes_each'] / scale:.2f} "
                         f"{unit} each ({row['kind']}) and {where}")
    for leg in refit.legs:
        lines.append(f"  {leg.name}: {leg.bytes / scale:.1f} {unit} over {leg.link} at {leg.gb_per_s:g} GB/s = "
                     f"{leg.seconds:.{digits}f} s")
    if refit.sliced is None:
        lines.append(f"  predicted {refit.seconds_overlapped:.{digits}f} s (legs overlapped) to "
                     f"{refit.seconds_serial:.{digits}f} s (in turn), bandwidth only")
    if refit.target is not None:
        lines.append("target     the sliced transfer plan, every replica sending (sync.transport=sliced, engines of one GPU each):")
        lines += _sliced(refit.target)
    lines.append("")
    if plan.shortfalls:
        lines += [f"DOES NOT FIT: {line}" for line in plan.shortfalls]
    else:
        worst = min(plan.gpu_memory - p.phases[p.peak_phase] for p in positions)
        lines.append(f"fits: at least {worst / GIB:.1f} GiB free on every GPU in every phase")
    return "\n".join(lines)

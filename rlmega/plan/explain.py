"""``rlmega plan --explain``: every term the verdict adds up, per position and phase, with its source."""

from __future__ import annotations

from rlmega.plan import formulas
from rlmega.plan.phases import PHASES, SOURCES
from rlmega.plan.planner import GIB, Plan
from rlmega.plan.report import stages_label

NAME = 36
CELL = 10


def _row(name: str, cells: list[str], note: str = "") -> str:
    return f"  {name:<{NAME}}" + "".join(f"{cell:>{CELL}}" for cell in cells) + (f"  {note}" if note else "")


def _position(plan: Plan, position, footnote) -> list[str]:
    pp, vpp = plan.pipeline
    flight = formulas.in_flight_microbatches(position.stages[0], pp, vpp, plan.microbatches)
    ranks = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in position.ranks)
    lines = [f"{stages_label(position.stages)} (ranks {ranks}; {position.layers}), rank {position.worst_rank}: {plan.tokens_per_microbatch} tokens per "
             f"micro-batch, {flight:g} in flight, recompute {plan.recompute}",
             _row("GiB", list(PHASES), "source")]
    names = list(dict.fromkeys(term.name for phase in PHASES for term in position.terms[phase]))
    for name in names:
        found = {phase: next((t for t in position.terms[phase] if t.name == name), None) for phase in PHASES}
        source = next(t.source for t in found.values() if t)
        lines.append(_row(name, [f"{t.bytes / GIB:.2f}" if t else "-" for t in found.values()], footnote(source)))
    lines.append(_row("total", [f"{position.phases[phase] / GIB:.2f}" for phase in PHASES]))
    lines.append(_row(f"free of {plan.gpu_memory / GIB:.1f}",
                      [f"{(plan.gpu_memory - position.phases[phase]) / GIB:.2f}" for phase in PHASES],
                      f"at least {plan.min_headroom / GIB:.1f} must stay free (plan.min_headroom_gib)"))
    for term in position.host_terms:
        lines.append(_row(f"host: {term.name}", [f"{term.bytes / GIB:.2f}"], footnote(term.source)))
    lines.append(_row("host total", [f"{position.host / GIB:.2f}"], "(per rank, at its peak)"))
    return lines


def render_explain(plan: Plan) -> str:
    """The terms of every position's phases and of the engines, each with a numbered source."""
    keys: list[str] = []

    def footnote(key: str) -> str:
        if key not in keys:
            keys.append(key)
        return f"[{keys.index(key) + 1}]"

    lines = ["Every term of the plan, per position (the rank with the largest optimizer shard) and phase:", ""]
    for position in plan.positions:
        lines += _position(plan, position, footnote) + [""]
    engine = plan.engine
    lines += [
        f"engines, per engine GPU ({engine.gpus} GPUs, {plan.placement}):",
        _row("weights", [f"{engine.weights / GIB:.2f}"], footnote("engine_weights")),
        _row("workspace", [f"{engine.workspace / GIB:.2f}"], footnote("engine_workspace")),
        _row("KV cache", [f"{engine.kv_cache / GIB:.2f}"], footnote("kv_cache")),
        _row("KV cache per token (KiB)", [f"{engine.kv_bytes_per_token / 1024:.1f}"], footnote("kv_per_token")),
        _row("tokens a replica needs per step", [f"{engine.tokens_needed:,}"], footnote("tokens_needed")),
        "",
    ]
    for sliced in (plan.refit.sliced, plan.refit.target):
        if sliced is not None:
            lines += _sliced(sliced) + [""]
    lines += ["sources:"]
    lines += [f"  [{index}] {EXPLAIN_SOURCES.get(key) or SOURCES[key]}" for index, key in enumerate(keys, 1)]
    lines.append("  the weight sync's bytes are measured per rank (the bridge's own ownership, meta_build); its times "
                 "are those bytes over plan.nvlink_gb_per_s (or the GPU preset's) and plan.ib_gb_per_s, bandwidth only (refit.py)")
    lines.append("  the sliced transfer plan: rlmega.sync.transfer_plan from the layout's pieces (rlmega.bridge.layout_pieces) "
                 "and the engines' regions (engine_bytes.py); per GPU the slowest of its directions and links "
                 "(plan.ib_gb_per_s / plan.gpus_per_node per NIC) plus messages x plan.message_latency_us (sliced_refit.py)")
    return "\n".join(lines)


def _sliced(sliced) -> list[str]:
    """The transfer plan's per-link table and its busiest GPUs (``rlmega.plan.sliced_refit``)."""
    lines = [f"refit, the sliced transfer plan ({sliced.label}; {sliced.tensors:,} tensors"
             + (f", {sliced.not_loaded} the engines do not load" if sliced.not_loaded else "")
             + f"; planned in {sliced.plan_seconds:.1f} s):",
             f"  {'link':<10}{'messages':>14}{'GB':>12}{'GB/s per GPU':>14}{'busiest GPU (s)':>17}"]
    for link, name in (("self", "on GPU"), ("nvlink", "NVLink"), ("network", "network")):
        speed = f"{sliced.gb_per_s[link]:g}" if sliced.gb_per_s[link] else "copy"
        lines.append(f"  {name:<10}{sliced.link_messages[link]:>14,}{sliced.link_bytes[link] / 1e9:>12.1f}"
                     f"{speed:>14}{sliced.link_seconds[link]:>17.2f}")
    lines.append(f"  busiest GPUs (time = slowest of out/in x NVLink/network + messages x "
                 f"{sliced.message_latency_s * 1e6:g} us; GB out / in):")
    for gpu in sliced.busiest:
        lines.append(f"  GPU {gpu.gpu:<6} {gpu.seconds:6.2f} s  bound by {gpu.bound:<12} network "
                     f"{gpu.sent['network'] / 1e9:.1f} / {gpu.received['network'] / 1e9:.1f}, NVLink "
                     f"{gpu.sent['nvlink'] / 1e9:.1f} / {gpu.received['nvlink'] / 1e9:.1f}, on GPU "
                     f"{gpu.received['self'] / 1e9:.1f}, {gpu.messages:,} messages")
    return lines


EXPLAIN_SOURCES = {
    "kv_per_token": "formula: 2 (K, V) x layers x ceil(kv_heads / engine tp) x head_dim x 2 bytes; MLA its latent, "
                    "layers x (kv_lora_rank + rope_dim) x 2 bytes (formulas.kv_bytes_per_token)",
    "tokens_needed": "formula: trainer.prompts_per_step x rollout.n / replicas x (data.max_prompt_length + "
                     "rollout.max_new_tokens)",
}

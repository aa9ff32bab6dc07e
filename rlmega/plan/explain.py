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
        "sources:",
    ]
    lines += [f"  [{index}] {EXPLAIN_SOURCES.get(key) or SOURCES[key]}" for index, key in enumerate(keys, 1)]
    lines.append("  the weight sync's bytes are measured per rank (the bridge's own ownership, meta_build); its times "
                 "are those bytes over plan.nvlink_gb_per_s (or the GPU preset's) and plan.ib_gb_per_s, bandwidth only (refit.py)")
    return "\n".join(lines)


EXPLAIN_SOURCES = {
    "kv_per_token": "formula: 2 (K, V) x layers x ceil(kv_heads / engine tp) x head_dim x 2 bytes; MLA its latent, "
                    "layers x (kv_lora_rank + rope_dim) x 2 bytes (formulas.kv_bytes_per_token)",
    "tokens_needed": "formula: trainer.prompts_per_step x rollout.n / replicas x (data.max_prompt_length + "
                     "rollout.max_new_tokens)",
}

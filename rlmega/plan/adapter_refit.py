"""What a sync with ``sync.lora=adapters`` streams: a LoRA actor's adapters in PEFT form, not the merged model.

``rlmega.workers.lora_export.peft_tensors`` sends, per HF projection an adapted Megatron layer stands for,
``lora_A [r, in]`` and ``lora_B [out, r]``: ``r x (in + out)`` numbers. A fused layer's ``A`` goes once per projection
(q, k and v each carry ``linear_qkv``'s ``A``; gate and up ``linear_fc1``'s), its ``B`` split by rows. The adapters are
built in their base layer's dtype (``rlmega.models.lora.Adapter``): the actor's, bf16 in a GPU run. The adapter
config (a few hundred bytes) is left out.
"""

from __future__ import annotations

from rlmega.plan.formulas import Shape

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def layer_kinds(spec) -> list[str]:
    """``"moe"`` or ``"dense"`` per decoder layer."""
    pattern = spec.config.get("moe_layer_freq")
    return ["moe" if (pattern[i] if isinstance(pattern, list) else spec.num_experts) else "dense"
            for i in range(spec.num_layers)]


def _projections(target: str, shape: Shape, ffn: int, gated: bool) -> list[tuple[int, int]]:
    """(in, out) of each HF projection a Megatron ``target`` of one layer stands for (none: the layer has no such
    module, e.g. ``linear_qkv`` under multi-latent attention, or an MLP of width 0)."""
    hidden = shape.hidden
    if target == "linear_qkv":
        if shape.mla:
            return []
        return [(hidden, shape.heads * shape.head_dim)] + [(hidden, shape.kv_heads * shape.head_dim)] * 2
    if target == "linear_proj":
        value_dim = shape.mla[4] if shape.mla else shape.head_dim
        return [(shape.heads * value_dim, hidden)]
    if not ffn:
        return []
    if target == "linear_fc1":
        return [(hidden, ffn)] * (2 if gated else 1)
    if target == "linear_fc2":
        return [(ffn, hidden)]
    return []  # experts.*: refused with sync.lora=adapters (rlmega.sync.config)


def adapter_elements(rank: int, target_modules, spec) -> int:
    """The numbers of every adapter ``peft_tensors`` sends: ``rank x (in + out)`` per projection per layer. A dense
    layer's MLP is ``ffn_hidden_size`` wide; a MoE layer's adapted MLP is its shared experts' (if any)."""
    shape = Shape.of(spec)
    gated = spec.config.get("gated_linear_unit", True)
    total = 0
    for kind in layer_kinds(spec):
        ffn = shape.ffn if kind == "dense" else shape.shared_ffn
        for target in target_modules:
            total += sum(rank * (inputs + outputs) for inputs, outputs in _projections(target, shape, ffn, gated))
    return total


def adapter_bytes(config, spec) -> int:
    """Bytes of the adapters one sync sends for the run ``config`` (its ``actor.lora`` and ``actor.dtype``)."""
    lora = config.actor.lora
    return adapter_elements(lora.rank, lora.target_modules, spec) * DTYPE_BYTES[config.actor.dtype or "bf16"]

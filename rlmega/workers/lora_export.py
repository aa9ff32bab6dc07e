"""A LoRA actor's adapters as a PEFT adapter (``adapter_config.json`` and ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the HF base model.

Megatron fuses q, k and v into ``linear_qkv`` and gate and up into ``linear_fc1``; one adapter there is, for each HF
projection, the same ``A`` and that projection's rows of ``B`` (split as the bridge splits the fused weight's rows).
PEFT's names: ``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (peft's
``get_peft_model_state_dict``, which drops the adapter's name from the keys). An expert's adapter is named per expert,
as the checkpoint format names the experts (``mlp.experts.{e}.gate_proj``): PEFT's serialized format, which peft
(0.21) converts onto transformers 5's fused experts when it loads the adapter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rlmega.bridge.mapping import RuleBook, to_hf
from rlmega.bridge.params import geometry_of
from rlmega.models import lora
from rlmega.models.spec import ModelSpec

PEFT_PREFIX = "base_model.model."


def _whole(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The TP-split ``tensor`` gathered along ``dim`` over ``group``."""
    if group.size() == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _canonical_weight(name: str) -> str:
    """The bridge's canonical name of an adapted layer's weight (layer indices from 0) from ``lora.adapters``' name."""
    _, _, number, rest = name.split(".", 3)
    return f"decoder.layers.{int(number) - 1}.{rest}.weight"


def _first_replica(adapter: lora.Adapter) -> bool:
    """Whether this rank's copy of ``adapter`` is its first data-parallel replica's (an expert's: of the
    expert-data-parallel group, whose ranks hold the same experts)."""
    from megatron.core import parallel_state as ps

    if adapter.expert:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


@torch.no_grad()
def peft_tensors(chunks: list, spec: ModelSpec) -> Optional[dict[str, torch.Tensor]]:
    """Every adapter under PEFT's names, whole, on global rank 0 (None elsewhere). Collective over all ranks."""
    book, geometry = RuleBook(spec.architecture), geometry_of(spec)
    mine: dict[str, torch.Tensor] = {}
    for name, adapter in lora.adapters(chunks):
        if _first_replica(adapter):
            tp = adapter.tp_group.size()
            a = _whole(adapter.lora_a, 1, adapter.tp_group) if adapter.row_parallel else adapter.lora_a.detach()
            b = adapter.lora_b.detach() if adapter.row_parallel else _whole(adapter.lora_b, 0, adapter.tp_group)
            if adapter.tp_group.rank() != 0:
                continue
            rule, hf_names = book.resolve(_canonical_weight(name))
            for hf_name, b_rows in to_hf(rule, b, hf_names, geometry, tp).items():
                module = PEFT_PREFIX + hf_name.removesuffix(".weight")
                mine[f"{module}.lora_A.weight"] = a.cpu().clone()
                mine[f"{module}.lora_B.weight"] = b_rows.cpu().contiguous().clone()
    everyone: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if dist.get_rank() != 0:
        return None
    return {name: tensor for part in everyone for name, tensor in part.items()}


def peft_adapter(chunks: list, spec: ModelSpec, config: lora.LoraConfig,
                 base_model: str) -> Optional[tuple[dict[str, torch.Tensor], dict]]:
    """The PEFT adapter: its tensors (``peft_tensors``) and ``adapter_config.json`` (``peft_config``), on global rank 0
    (None elsewhere). What the export writes and what a weight sync with ``sync.lora=adapters`` sends. Collective."""
    tensors = peft_tensors(chunks, spec)
    return None if tensors is None else (tensors, peft_config(config, tensors, base_model))


def peft_config(config: lora.LoraConfig, tensors: dict[str, torch.Tensor], base_model: str) -> dict:
    """``adapter_config.json`` for ``tensors``: the HF module names they adapt, rank, alpha, dropout, no bias."""
    targets = sorted({name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for name in tensors
                      if name.endswith(".lora_A.weight")})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "bias": "none",
        "target_modules": targets, "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
    }

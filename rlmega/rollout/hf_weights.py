"""Where each Hugging Face on-disk weight name lands in a transformers model's in-memory tensors.

Most names are identical on disk and in memory. Mixture-of-experts layers are not: checkpoints store
one matrix per expert (``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],
``down_proj`` [H, I]; Mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``), while transformers
5 keeps each layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] holding gate rows
``[:I]`` then up rows ``[I:]``, and ``mlp.experts.down_proj`` [E, H, I], neither transposed).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
from torch import nn

from rlmega.rollout.protocol import UnknownWeightError


@dataclass(frozen=True)
class WeightTarget:
    """The region of one in-memory tensor that an on-disk name fills."""

    tensor_name: str  # canonical state_dict key of the tensor written to
    index: tuple[int | slice, ...]  # region of that tensor; () is all of it
    shape: tuple[int, ...]  # shape the incoming tensor must have
    slots: tuple[str, ...]  # canonical on-disk names this write fills (re-sync bookkeeping)


@dataclass(frozen=True)
class ExpertCheckpointNames:
    """How a checkpoint names a MoE block and its per-expert projections."""

    block: str  # the MoE block's name inside a decoder layer
    gate: str
    up: str
    down: str


QWEN_STYLE = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_STYLE = ExpertCheckpointNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
CHECKPOINT_NAMES_BY_MODEL_TYPE = {"mixtral": MIXTRAL_STYLE, "minimax": MIXTRAL_STYLE}
# transformers 5 holds Qwen2.5-VL's language model and vision tower under these paths; checkpoints (and
# rlmega's export) name them ``model.*`` and ``visual.*``.
PREFIX_RENAMES_BY_MODEL_TYPE = {"qwen2_5_vl": {"model.language_model": "model", "model.visual": "visual"}}


def _has_split_expert_layout(experts: nn.Module) -> bool:
    """True for the [E, 2I, H] gate-then-up / [E, H, I] layout that per-expert names map into.

    transformers marks other layouts (transposed, interleaved gate/up, biased, ungated) with flags
    set by ``use_experts_implementation``; modules without the flags are checked by shape alone.
    """
    gate_up, down = experts.gate_up_proj, experts.down_proj
    flags_ok = (not getattr(experts, "is_transposed", False) and getattr(experts, "is_concatenated", True)
                and not getattr(experts, "has_bias", False) and getattr(experts, "has_gate", True))
    num_experts, two_inter, hidden = gate_up.shape
    return flags_ok and tuple(down.shape) == (num_experts, hidden, two_inter // 2) and two_inter % 2 == 0


def _fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        path: module for path, module in model.named_modules()
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3
        and isinstance(getattr(module, "down_proj", None), nn.Parameter) and module.down_proj.dim() == 3
    }


class HFWeightMap:
    """Resolves on-disk weight names (and in-memory names) to regions of a model's tensors.

    The weights are the model's ``state_dict`` entries: parameters and persistent buffers (e.g.
    DeepSeek's ``e_score_correction_bias``). Tied tensors (``lm_head.weight`` sharing the embedding)
    resolve to one canonical tensor, the first name ``state_dict`` lists.
    """

    def __init__(self, model: nn.Module):
        self.model_type: str = getattr(model.config, "model_type", "unknown")
        names = CHECKPOINT_NAMES_BY_MODEL_TYPE.get(self.model_type, QWEN_STYLE)
        state = model.state_dict(keep_vars=True)
        canonical_by_id: dict[int, str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if id(tensor) not in canonical_by_id:
                canonical_by_id[id(tensor)] = name
                self.tensors[name] = tensor
        self.shapes: dict[str, tuple[int, ...]] = {name: tuple(t.shape) for name, t in self.tensors.items()}

        experts_modules = _fused_experts_modules(model)
        # In-memory MoE block path -> its on-disk path, where they differ (Mixtral: "mlp" is "block_sparse_moe";
        # a vision-language model keeps its parts under other prefixes in memory than on disk).
        block_renames = dict(PREFIX_RENAMES_BY_MODEL_TYPE.get(self.model_type, {}))
        for path in experts_modules:
            memory_block = path.rpartition(".")[0]
            layer = memory_block.rpartition(".")[0]
            disk_block = f"{layer}.{names.block}" if layer else names.block
            if disk_block != memory_block:
                block_renames[memory_block] = disk_block
        self._targets: dict[str, WeightTarget] = {}
        for name in self.tensors:
            module_path, _, attr = name.rpartition(".")
            experts = experts_modules.get(module_path)
            if experts is not None and attr in ("gate_up_proj", "down_proj") and _has_split_expert_layout(experts):
                self._add_expert_targets(name, attr, self._disk_name(module_path, block_renames), names)
            else:  # same name on disk, up to the MoE block's rename; fused layouts we cannot split stay whole
                disk_name = self._disk_name(name, block_renames)
                self._targets[disk_name] = self._targets[name] = WeightTarget(
                    name, (), self.shapes[name], (disk_name,))
        for alias, tensor in state.items():  # tied names write the canonical tensor
            self._targets.setdefault(alias, self._targets[canonical_by_id[id(tensor)]])
        self.slots: frozenset[str] = frozenset(slot for t in self._targets.values() for slot in t.slots)

    @staticmethod
    def _disk_name(name: str, block_renames: dict[str, str]) -> str:
        parts = name.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth])
            if prefix in block_renames:
                return block_renames[prefix] + name[len(prefix):]
        return name

    def _add_expert_targets(self, name: str, attr: str, disk_experts: str, names: ExpertCheckpointNames) -> None:
        """Per-expert on-disk names into fused ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
        shape = self.shapes[name]
        num_experts = shape[0]
        if attr == "gate_up_proj":
            inter = shape[1] // 2
            parts = ((names.gate, slice(0, inter)), (names.up, slice(inter, 2 * inter)))
            per_expert = [(f"{disk_experts}.{e}.{proj}.weight", (e, rows), (inter, shape[2]))
                          for e in range(num_experts) for proj, rows in parts]
        else:  # down_proj
            per_expert = [(f"{disk_experts}.{e}.{names.down}.weight", (e,), shape[1:]) for e in range(num_experts)]
        for disk_name, index, expert_shape in per_expert:
            self._targets[disk_name] = WeightTarget(name, index, expert_shape, (disk_name,))
        # The fused in-memory name is accepted too (a trainer may send it whole); it fills every expert.
        self._targets[name] = WeightTarget(name, (), shape, tuple(disk_name for disk_name, _, _ in per_expert))

    def resolve(self, name: str) -> WeightTarget:
        """The target of ``name``; raises ``UnknownWeightError`` naming it (with close matches)."""
        target = self._targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, self._targets, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownWeightError(
                f"unknown weight name {name!r}: not a weight of this {self.model_type} model{hint}")
        return target

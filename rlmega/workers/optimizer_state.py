"""An optimizer's checkpointed state, loadable in any training layout.

megatron-core names an optimizer's tensors by the model parameters they belong to, so they load in any
layout, as long as no prefix names the optimizer that held them (``SHARDED_METADATA``: megatron-core
chains a second optimizer for the experts when ep > 1 and would otherwise prefix its keys). Its plain
values (the param groups, the step Adam shares across parameters) are written once, by rank 0, in the
structure of rank 0's optimizer, and come back in that structure beside tensors in this rank's: one
optimizer or a chain of them, and a rank 0 whose stage has no experts writes no step for the expert
optimizer. ``for_this_optimizer`` gives the loaded state the structure this rank's optimizer reads.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""Megatron's ``sharded_state_dict`` metadata: the distributed optimizer's format that loads in other
layouts (0.16's default writes flattened ranges its own ShardedTensor refuses) and keys without the
chain's prefix."""

LEGACY_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""Checkpoints written before ``SHARDED_METADATA``: the chain's prefix on the expert optimizer's keys."""


def sub_optimizers(optimizer) -> list:
    """The optimizers a Megatron optimizer steps with: a chain's (dense, experts), or itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_state(state: dict) -> dict:
    """Where a sub-optimizer keeps its torch state (param groups, per-parameter state): Megatron's
    mixed-precision optimizers nest it under "optimizer", the fp32 one does not."""
    inner = state.get("optimizer")
    return inner if isinstance(inner, dict) else state


def _step(state: dict) -> Optional[Any]:
    """The step a sub-optimizer's plain values record: the shared per-parameter step, or (the distributed
    optimizer without transformer-engine) the param groups' step."""
    torch_state = _torch_state(state)
    step = torch_state.get("state", {}).get("common_step")
    if step is None:
        steps = [group["step"] for group in torch_state.get("param_groups", []) if group.get("step") is not None]
        step = steps[0] if steps else None
    return step


def for_this_optimizer(optimizer, loaded: dict):
    """``loaded`` (``dist_checkpointing.load``'s optimizer entry) as ``optimizer.load_state_dict`` reads it."""
    subs = sub_optimizers(optimizer)
    chained_keys = sorted(key for key in loaded if isinstance(key, int))
    top = {key: value for key, value in loaded.items() if not isinstance(key, int)}
    # Rank 0's structure: plain values beside this rank's chain (one optimizer), or in chained entries
    # beside this rank's one optimizer's tensors (a chain), or where this rank's are.
    if len(subs) > 1:
        saved = [top] if top else [loaded[key] for key in chained_keys]
    else:
        saved = [loaded[key] for key in chained_keys] if chained_keys else [top]
    parts = [loaded.get(index, {}) for index in range(len(subs))] if len(subs) > 1 else [top]
    steps = [step for step in map(_step, saved) if step is not None]
    step = max(steps) if steps else None  # the chain keeps its optimizers' steps equal
    same_structure = len(saved) == len(parts)
    for index, (sub, part) in enumerate(zip(subs, parts)):
        for key, value in saved[min(index, len(saved) - 1)].items():
            if not isinstance(key, int) and key not in part:
                part[key] = copy.deepcopy(value)  # plain values only rank 0 wrote (a format's name, ...)
        own = sub.state_dict()
        torch_state = part.setdefault("optimizer", {}) if "optimizer" in own else part
        groups = torch_state.get("param_groups", [])
        replaced = not same_structure or not groups or any(set(group) <= {"params"} for group in groups)
        if replaced:
            # rank 0's groups were another split of the parameters (what comes back in this rank's
            # structure is the parameters alone): this optimizer's own groups (their learning rates
            # and weight decay come back with the LR schedule, loaded next).
            torch_state["param_groups"] = copy.deepcopy(_torch_state(own)["param_groups"])
        if step is not None:  # the chain's optimizers share one step; rank 0 may have written it for one only
            if any("step" in group for group in torch_state["param_groups"]):
                for group in torch_state["param_groups"]:
                    group["step"] = step
            else:
                torch_state.setdefault("state", {})["common_step"] = step
    if len(subs) == 1:
        return parts[0]
    return {index: part for index, part in enumerate(parts)}


def clear_moments(optimizer) -> int:
    """Zero Adam's moments (``exp_avg``, ``exp_avg_sq``) in place, wherever each sub-optimizer keeps them; the step
    counts stay. For parameters restarted from new values (LoRA adapters folded into their base). Returns the
    tensors zeroed."""
    import torch

    cleared = 0
    for inner in sub_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for state in torch_optimizer.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if isinstance(state.get(name), torch.Tensor):
                    state[name].zero_()
                    cleared += 1
    return cleared

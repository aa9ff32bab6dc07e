"""Which settings a resumed run may change: the table, and the comparison of a run's saved settings with new ones.

A checkpoint holds weights, optimizer and LR schedule, and the data sampler's position, trained under the settings
saved beside it (``run_dir/checkpoints/config.yaml``). A setting that changes what is trained (the algorithm, the
model, the data, the reward, the sampling, the optimizer: Megatron's schedule and Adam keep the checkpoint's
values whatever the config says) or that the checkpoint cannot follow is ``FIXED``: resuming with another value
is refused. ``FREE`` settings (logging, metrics, validation, resources, layouts that the checkpoint reshards into)
may change, and are listed when they do.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

FIXED = "fixed"
"""Changes what is trained, or the checkpoint cannot follow: refused."""
FREE = "free"
"""May change between invocations of one run: allowed, and listed."""
LENGTH = "length"
"""How long the run is: allowed (a run already at its end is refused by ``rlmega.trainer.resume``)."""
NOT_COMPARED = "not compared"
"""How this invocation runs, not what the run is."""


def _roles(setting: str, kind: str) -> dict[str, str]:
    """The same entry for the actor, the reference and the critic."""
    return {f"{role}.{setting}": kind for role in ("actor", "ref", "critic")}


SETTINGS: dict[str, str] = {
    # A setting takes the kind of the longest entry that is a prefix of its dotted name.
    "run_dir": NOT_COMPARED, "resume": NOT_COMPARED, "overwrite": NOT_COMPARED,
    "model": FIXED,
    "data": FIXED,
    "val_data": FREE,
    "reward": FIXED,
    "reward.num_workers": FREE, "reward.timeout_s": FREE, "reward.rules_in_workers": FREE,
    "reward.val_weights": FREE, "reward.monitor": FREE,
    "reward_model": FIXED,
    "reward_model.layout": FREE, "reward_model.cpus_per_rank": FREE, "reward_model.gpus_per_rank": FREE,
    "reward_model.offload": FREE, "reward_model.max_tokens_per_microbatch": FREE,
    "judge": FIXED,
    "judge.backend": FREE, "judge.num_engines": FREE, "judge.cpus_per_engine": FREE, "judge.gpus_per_engine": FREE,
    "judge.gpu_memory_utilization": FREE, "judge.tensor_parallel_size": FREE, "judge.engine_kwargs": FREE,
    "teacher": FIXED,
    "teacher.layout": FREE, "teacher.cpus_per_rank": FREE, "teacher.gpus_per_rank": FREE, "teacher.offload": FREE,
    "teacher.max_tokens_per_microbatch": FREE,
    "layout": FREE,  # checkpoints load into any layout (per-rank RNG states only at the same world size)
    "actor": FIXED, "ref": FIXED, "critic": FIXED,
    **_roles("optimizer.distributed_optimizer", FREE), **_roles("optimizer.cpu_offload_fraction", FREE),
    **_roles("batching", FREE), **_roles("sequence_parallel", FREE), **_roles("offload", FREE),
    **_roles("recompute_granularity", FREE), **_roles("recompute_method", FREE),
    **_roles("recompute_num_layers", FREE), **_roles("recompute_modules", FREE),
    **_roles("activation_offload_layers", FREE),
    "rollout": FIXED,
    "rollout.backend": FREE, "rollout.engine_kwargs": FREE, "rollout.gpu_memory_utilization": FREE,
    "rollout.tensor_parallel_size": FREE, "rollout.data_parallel_size": FREE, "rollout.expert_parallel_size": FREE,
    "rollout.max_num_batched_tokens": FREE, "rollout.num_engines": FREE, "rollout.placement": FREE,
    "rollout.colocated_offload": FREE, "rollout.engine_spread": FREE, "rollout.cpus_per_engine": FREE,
    "rollout.gpus_per_engine": FREE, "rollout.val_temperature": FREE, "rollout.val_top_p": FREE,
    "rollout.val_top_k": FREE, "rollout.val_n": FREE,
    "rollout.restart_dead_engines": FREE, "rollout.restart_window_steps": FREE,
    "agent": FIXED,
    # The harness makes the trajectories (fixed); where the gateway listens and its limits are how it runs.
    "gateway": FIXED,
    "gateway.host": FREE, "gateway.port": FREE, "gateway.token": NOT_COMPARED, "gateway.max_concurrent_sessions": FREE,
    "gateway.session_timeout_s": FREE,
    "agent.tool_timeout_s": FREE, "agent.tool_memory_mb": FREE, "agent.num_tool_workers": FREE,
    "sync": FREE,
    "algorithm": FIXED,
    "trainer": FIXED,
    "trainer.total_steps": LENGTH, "trainer.total_epochs": LENGTH,
    "trainer.save_every": FREE, "trainer.max_checkpoints_to_keep": FREE, "trainer.val_every": FREE,
    "trainer.val_before_train": FREE, "trainer.val_prompts": FREE, "trainer.log_val_generations": FREE,
    "trainer.fuse_old_logprob": FREE,  # the same gradient either way
    "metrics": FREE,
    "cluster": FREE,
    "plan": FREE,
    "export_hf": FREE,
    "tiny_assets": FREE,
    "tiny_assets_max_operand": FIXED, "tiny_vision": FIXED, "tiny_reward_model": FIXED, "tiny_teacher": FIXED,
}


def kind_of(setting: str) -> str:
    """The kind of a dotted setting name by ``SETTINGS``; one no entry covers is ``FIXED``."""
    parts = setting.split(".")
    for length in range(len(parts), 0, -1):
        kind = SETTINGS.get(".".join(parts[:length]))
        if kind is not None:
            return kind
    return FIXED


@dataclasses.dataclass
class SettingChanges:
    """The settings whose value differs between the saved run and this invocation: ``(name, old, new)`` each."""

    refused: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)
    allowed: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)


def compare_settings(saved: dict, current: dict, leaves: list[str]) -> SettingChanges:
    """``saved`` and ``current``: plain settings trees (as read from YAML); ``leaves``: the dotted names of the
    config's fields to compare. A name the saved tree lacks (a field added since) is not compared. Paths under the
    saved ``run_dir`` count as the same paths under the current one, so a run directory may move."""
    changes = SettingChanges()
    old_root, new_root = saved.get("run_dir"), current.get("run_dir")
    for name in leaves:
        kind = kind_of(name)
        old, found = _lookup(saved, name)
        new, _ = _lookup(current, name)
        if kind == NOT_COMPARED or not found:
            continue
        old = _moved(old, old_root, new_root)
        if old == new:
            continue
        (changes.refused if kind == FIXED else changes.allowed).append((name, old, new))
    return changes


def leaf_names(config, prefix: str = "") -> list[str]:
    """The dotted names of every field of the dataclass ``config`` that is not itself a dataclass."""
    names = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            names += leaf_names(value, f"{prefix}{field.name}.")
        else:
            names.append(f"{prefix}{field.name}")
    return names


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    """``a.b: old -> new, c: old -> new`` with values as they are written in overrides."""
    return ", ".join(f"{name}: {_shown(old)} -> {_shown(new)}" for name, old, new in changes)


def _shown(value: Any) -> str:
    return value if isinstance(value, str) and value else json.dumps(value)


def _lookup(tree: dict, name: str) -> tuple[Any, bool]:
    node = tree
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None, False
        node = node[part]
    return node, True


def _moved(value: Any, old_root: Any, new_root: Any) -> Any:
    """``value`` with its paths under ``old_root`` re-rooted under ``new_root`` (strings, in lists and dicts too)."""
    if not isinstance(old_root, str) or not isinstance(new_root, str):
        return value
    old_root, new_root = old_root.rstrip("/"), new_root.rstrip("/")
    if not old_root or old_root == new_root:
        return value
    if isinstance(value, str):
        return new_root + value[len(old_root):] if value == old_root or value.startswith(old_root + "/") else value
    if isinstance(value, list):
        return [_moved(item, old_root, new_root) for item in value]
    if isinstance(value, dict):
        return {key: _moved(item, old_root, new_root) for key, item in value.items()}
    return value

"""Worker checkpoints: Megatron ``dist_checkpointing`` directories that load into any parallel layout.

Layout on disk (Megatron's own convention, so its tools and ``rlmega convert`` read it)::

    root/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
    root/iter_0000042/                         model, optimizer, LR schedule, RNG, step, extra state
    root/iter_0000042/rlmega.json              step and layout (written last, before the rename)

A checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed when every rank has finished, and
only then does the tracker move to it, so a crash mid-save never leaves a half-written checkpoint
that looks like the latest. Model and optimizer tensors are sharded by their global position, so
a checkpoint saved at one layout (TP=2) loads at another (TP=1, PP=2). Per-rank RNG states only
restore at the same world size; elsewhere they are skipped with a warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from rlmega.bridge.hf_checkpoint import CheckpointError
from rlmega.bridge.torch_dist_files import check_files, find_damage, read_index
from rlmega.models.lora import is_adapter_key
from rlmega.models.spec import sharded_model_state
from rlmega.workers.optimizer_state import LEGACY_METADATA, SHARDED_METADATA, for_this_optimizer, sub_optimizers

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "rlmega.json"


def _in_process_write_results() -> None:
    """megatron-core 0.16's synchronous ``dist_checkpointing.save`` hands each rank's write results over a
    queue that it creates, at the first save, as a ``spawn`` multiprocessing Manager: a process that imports
    torch (~5 s of CPU on a small machine) and then lives as long as the rank (~300 MB). We only save
    synchronously, so the results are put and taken by the rank itself, and a queue of the rank's own serves.
    Installed once, before the first save; other releases are left alone (0.16 through 0.19 keep the queue in the
    module's ``_results_queue`` and create it only while that is None)."""
    from megatron.core import __version__
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from rlmega.parallel.mcore_version import SUPPORTED, major_minor

    if major_minor(__version__) in SUPPORTED and filesystem_async._results_queue is None:
        import queue
        filesystem_async._results_queue = queue.Queue()


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint at the given path."""


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def iteration_dirs(root: str | Path) -> dict[int, Path]:
    """Every ``iter_XXXXXXX`` directory under ``root`` by step, complete or not (staging ``.tmp`` ones aside)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = (re.fullmatch(r"iter_(\d+)", entry.name) for entry in root.iterdir() if entry.is_dir())
    return {int(match.group(1)): root / match.group(0) for match in found if match}


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint whose save finished (its metadata is written last, before the rename)."""
    return (Path(directory) / METADATA).is_file()


def complete_steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first."""
    return sorted(step for step, directory in iteration_dirs(root).items() if is_complete(directory))


def latest_checkpoint(path: str | Path) -> Optional[Path]:
    """The complete checkpoint at ``path``: an ``iter_*`` directory itself, or the one its tracker names."""
    path = Path(path)
    if is_complete(path):
        return path
    tracker = path / TRACKER
    if not tracker.is_file():
        return None
    candidate = iteration_dir(path, int(tracker.read_text().strip()))
    return candidate if is_complete(candidate) else None


def _without_ddp(chunk):
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def _rng_object(is_loading: bool):
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = None if is_loading else {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _with_optimizer_states(optimizer) -> None:
    """Megatron's distributed optimizer describes its state for a load from the state it holds, which a
    fresh one does not have yet (without transformer-engine or apex it asserts on the missing step count):
    Megatron's own dummy states, which the load then overwrites."""
    for inner in sub_optimizers(optimizer):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _sharded_state(chunks, optimizer, scheduler, *, is_loading: bool, with_rng: bool,
                   optimizer_metadata: dict = SHARDED_METADATA, adapters_only: bool = False) -> dict:
    state = sharded_model_state([_without_ddp(chunk) for chunk in chunks])
    if adapters_only:  # LoRA over base weights that the HF checkpoint holds: the adapters alone
        state = {key: {name: value for name, value in model.items() if is_adapter_key(name)}
                 for key, model in state.items()}
    if optimizer is not None:
        model_state = state["model"] if len(state) == 1 else dict(state)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=dict(optimizer_metadata))
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object(is_loading)
    return state


def save_checkpoint(root: str | Path, step: int, chunks: list, optimizer=None, scheduler=None, *,
                    layout_description: str = "", extra: Optional[dict] = None, adapters_only: bool = False) -> Path:
    """Save everything needed to continue training as ``root/iter_{step}``; collective. Returns the path.
    ``adapters_only``: of the model, only its LoRA adapters (the base weights are the HF checkpoint's)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, staging = iteration_dir(root, step), iteration_dir(root, step).with_suffix(".tmp")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
        staging.mkdir()
    dist.barrier()
    state = _sharded_state(chunks, optimizer, scheduler, is_loading=False, with_rng=True, adapters_only=adapters_only)
    state["step"] = step
    state["extra"] = extra or {}
    _in_process_write_results()
    dist_checkpointing.save(state, str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        (staging / METADATA).write_text(json.dumps(
            {"step": step, "world_size": dist.get_world_size(), "layout": layout_description,
             "optimizer_keys": "by_parameter", "model": "adapters" if adapters_only else "whole"}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        tracker_tmp = root / (TRACKER + ".tmp")
        tracker_tmp.write_text(str(step))
        os.replace(tracker_tmp, root / TRACKER)
    dist.barrier()
    return final


def rotate_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``, and any staging
    directory a killed save left; the checkpoint the tracker names is always kept. Not collective:
    call it on one rank, after a save is complete. Returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    newest = latest_checkpoint(root)
    complete = [iteration_dir(root, step) for step in complete_steps(root)]
    doomed = [d for d in complete[:-keep] if d != newest] + list(root.glob("iter_*.tmp"))
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)
    return doomed


def _older_one(directory: Path) -> str:
    return f"restore it from a copy, or delete {directory} to go on from the checkpoint before it"


def load_checkpoint(path: str | Path, chunks: list, optimizer=None, scheduler=None) -> tuple[int, dict]:
    """Load the checkpoint at ``path`` (an ``iter_*`` directory or its root) into this rank's model,
    optimizer and schedule, whatever layout it was saved with; collective. Returns ``(step, extra)``; ``extra``
    says ``adapters_only`` when the checkpoint held a model's LoRA adapters alone (the base weights stay as they
    are). A file of it that is missing, cut short or garbled raises CheckpointError naming the file."""
    from megatron.core import dist_checkpointing

    directory = latest_checkpoint(path)
    if directory is None:
        raise CheckpointNotFoundError(
            f"no complete checkpoint at {path}: expected an iter_* directory with {METADATA}, or a directory "
            f"with {TRACKER} naming one"
        )
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except ValueError as error:
        raise CheckpointError(f"{directory / METADATA} is damaged ({error}); {_older_one(directory)}") from None
    same_world = metadata["world_size"] == dist.get_world_size()
    if not same_world:
        warnings.warn(
            f"checkpoint {directory} was saved by {metadata['world_size']} ranks, this job has "
            f"{dist.get_world_size()}: model and optimizer are resharded, per-rank RNG states are not restored"
        )
    if optimizer is not None:
        _with_optimizer_states(optimizer)
    adapters_only = metadata.get("model") == "adapters"
    sharded = _sharded_state(chunks, optimizer, scheduler, is_loading=True, with_rng=same_world,
                             optimizer_metadata=SHARDED_METADATA if metadata.get("optimizer_keys") == "by_parameter"
                             else LEGACY_METADATA, adapters_only=adapters_only)
    if adapters_only and not any(sharded[key] for key in sharded if key.startswith("model")):
        raise CheckpointError(f"checkpoint {directory} holds LoRA adapters only; this model has none "
                              "(set actor.lora.rank and target_modules as in the run that saved it)")
    check_files(directory, read_index(directory))  # a missing or cut shard file, named before Megatron reads any
    try:
        # The CPU-offloaded optimizer's param groups name the torch optimizer classes it steps with.
        with torch.serialization.safe_globals([torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]):
            state = dist_checkpointing.load(sharded, str(directory))
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        damage = find_damage(directory)  # reads the files whole: only now
        if damage is None:
            raise
        raise CheckpointError(f"{damage}; {_older_one(directory)}") from error
    model_keys = [key for key in state if key == "model" or (key.startswith("model") and key[5:].isdigit())]
    for chunk, key in zip(chunks, sorted(model_keys, key=lambda key: int(key[5:] or 0))):
        _load_model_state(_without_ddp(chunk), state[key], adapters_only)
    if optimizer is not None:
        optimizer.load_state_dict(for_this_optimizer(optimizer, state["optimizer"]))
        scheduler.load_state_dict(state["scheduler"])
    if same_world:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        rng = state["rng_state"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return int(state["step"]), {**state["extra"], "adapters_only": adapters_only}


def _load_model_state(model, state: dict, adapters_only: bool) -> None:
    """``model.load_state_dict(state)``; with ``adapters_only`` the state holds every adapter and nothing else."""
    if not adapters_only:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if is_adapter_key(key)]
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's adapters do not fit this model: {(missing or unexpected)[0]!r} is "
                              f"{'missing' if missing else 'unexpected'}; use the LoRA settings it was saved with")

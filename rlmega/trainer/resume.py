"""How a run starts: from the newest complete checkpoint in ``run_dir`` (``resume=auto``) or afresh, decided before
any part of it starts, so that a run never trains over checkpoints it was not told to replace.

    run_dir/checkpoints/<role>/iter_XXXXXXX/    one per save and trained role (rlmega/workers/checkpoint.py)
    run_dir/checkpoints/config.yaml             the settings those checkpoints were trained with

``resume=auto``: the step to continue from is the newest one whose checkpoint is complete in every role's directory
(the actor's tracker file only has to agree; where it does not, one line says why the step was chosen); actor
iteration directories of which none is complete are refused, named. Then the saved settings are compared with these
(``rlmega.trainer.resume_settings``): a change to what is trained is refused naming each setting, the others are
listed; a run whose checkpoint is past its last step is refused, one exactly at it finishes (its HF export).
``resume=never`` over existing checkpoints is refused unless ``overwrite``; with it, the old checkpoints are removed
at the new run's first save (a run that fails before that leaves them as they were).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Optional

from rlmega.errors import UserError
from rlmega.trainer.resume_settings import compare_settings, describe, leaf_names
from rlmega.workers.checkpoint import METADATA, TRACKER, complete_steps, iteration_dir, iteration_dirs

SETTINGS_FILE = "config.yaml"
NAMES_SHOWN = 4


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
    step: int = 0
    """The step of the checkpoint the run continues from; 0: a new run."""
    replaces_checkpoints: bool = False
    """A new run told to replace the checkpoints in ``run_dir`` (``overwrite``): they go at its first save."""


def decide_resume(config) -> ResumeDecision:
    """Where the run described by ``config`` starts, or a ``UserError`` saying why it must not; prints a line for
    a checkpoint chosen against the tracker file and one for settings changed since the checkpoint."""
    run_dir, checkpoints = Path(config.run_dir), Path(config.run_dir) / "checkpoints"
    present = _iteration_names(checkpoints)
    if config.resume == "never":
        if present and not config.overwrite:
            raise UserError(
                f"resume=never would write over the checkpoints in {checkpoints} ({_listed(present)}); pass "
                f"--overwrite (overwrite=true) to start afresh and replace them, use another run_dir, or leave out "
                f"resume=never to continue that run")
        return ResumeDecision(replaces_checkpoints=bool(present))
    if present and config.overwrite:
        raise UserError(
            f"overwrite=true (--overwrite) replaces checkpoints only for a run started afresh, and resume=auto "
            f"would continue from those in {checkpoints}; add resume=never to start afresh over them, or leave out "
            f"--overwrite to continue that run")
    step, reason = newest_complete(checkpoints)
    if step is None:
        if present:
            raise UserError(
                f"{checkpoints} holds {_listed(present)} but no complete checkpoint (its {METADATA}, and the same "
                f"step of every other role saved) to resume from; restore one, start afresh over them with "
                f"resume=never --overwrite, or use another run_dir")
        return ResumeDecision()
    settings_line = _compare_settings(config, checkpoints)
    total_steps = config.trainer.total_steps
    if config.trainer.total_epochs is None:  # with epochs the length needs the data: the trainer checks it
        refuse_finished_run(run_dir, step, total_steps, "trainer.total_steps", total_steps)
    for line in (f"resuming from iter_{step:07d}: {reason}" if reason else "", settings_line):
        if line:
            print(line, flush=True)
    return ResumeDecision(step=step)


def newest_complete(checkpoints: Path) -> tuple[Optional[int], Optional[str]]:
    """The newest step complete in every role's directory, and why it is not the one the actor's tracker file
    names (None when it is); ``(None, None)`` when there is none."""
    roles = [role for role in sorted(checkpoints.iterdir()) if iteration_dirs(role)] if checkpoints.is_dir() else []
    actor = checkpoints / "actor"
    if actor not in roles:
        return None, None
    complete = set.intersection(*(set(complete_steps(role)) for role in roles))
    if not complete:
        return None, None
    newest, tracker = max(complete), actor / TRACKER
    if not tracker.is_file():
        return newest, f"{TRACKER} was missing"
    text = tracker.read_text().strip()
    if not text.isdigit():
        return newest, f"{TRACKER} holds {text!r}, not a step"
    named = int(text)
    if named == newest:
        return newest, None
    if named in complete:
        return newest, (f"{TRACKER} named the older iter_{named:07d} (to go back to it, delete the newer iter_* "
                        f"directories)")
    missing = [f"{role.name}/{iteration_dir(role, named).name}" for role in roles
               if not iteration_dir(role, named).is_dir()]
    if missing:
        return newest, f"{TRACKER} named iter_{named:07d}, which is not there ({', '.join(missing)} missing)"
    unfinished = [f"{role.name}/{iteration_dir(role, named).name}" for role in roles
                  if named not in complete_steps(role)]
    return newest, f"{TRACKER} named iter_{named:07d}, which is incomplete (no {METADATA} in {', '.join(unfinished)})"


def refuse_finished_run(run_dir: Path, step: int, total_steps: int, setting: str, value: int) -> None:
    """A checkpoint past the run's last step is refused: fewer steps than it already trained is another run.
    At the last step exactly the run finishes (nothing to train, the HF export written again), so a job
    requeued after a SIGTERM in its last step still writes its weights. ``setting=value`` decides
    ``total_steps``."""
    if step > total_steps:
        raise UserError(
            f"{run_dir} already reached step {step}, and {setting}={value} asks for {total_steps} steps in all: "
            f"nothing is left to train; raise {setting} to go on from step {step}, or use another run_dir for a "
            f"new run")
    if step == total_steps:
        print(f"{run_dir} already reached its last step {step}: nothing to train, finishing (the HF export)",
              flush=True)


def prepare_first_save(run_dir: Path, config, decision: ResumeDecision) -> None:
    """Before this invocation's first checkpoint: the replaced run's checkpoints go (``overwrite``), and these
    settings are kept beside the checkpoints, written whole or not at all."""
    checkpoints = Path(run_dir) / "checkpoints"
    if decision.replaces_checkpoints:
        shutil.rmtree(checkpoints, ignore_errors=True)
    checkpoints.mkdir(parents=True, exist_ok=True)
    staging = checkpoints / f".{SETTINGS_FILE}.tmp"
    staging.write_text(_yaml(config))
    os.replace(staging, checkpoints / SETTINGS_FILE)


def _compare_settings(config, checkpoints: Path) -> str:
    """A ``UserError`` naming the settings that changed since the checkpoints were saved and may not; else the
    line that lists those that changed and may (empty: none did)."""
    import yaml

    saved_file = checkpoints / SETTINGS_FILE
    if not saved_file.is_file():
        return f"resuming without comparing settings: {saved_file} is missing"
    try:
        saved = yaml.safe_load(saved_file.read_text())
    except yaml.YAMLError:
        saved = None
    if not isinstance(saved, dict):
        raise UserError(f"{saved_file} does not hold the settings of a run; restore it, or delete it to resume "
                        f"without comparing settings")
    changes = compare_settings(saved, yaml.safe_load(_yaml(config)), leaf_names(config))
    if changes.refused:
        raise UserError(
            f"the checkpoints in {checkpoints} were trained with other settings: {describe(changes.refused)}; "
            f"use another run_dir for a run with the new settings, or replace that run with resume=never "
            f"--overwrite")
    return f"resuming with changed settings: {describe(changes.allowed)}" if changes.allowed else ""


def _yaml(config) -> str:
    from rlmega.config.load import to_yaml

    return to_yaml(config)


def _iteration_names(checkpoints: Path) -> list[str]:
    """``actor/iter_XXXXXXX`` of the actor's iteration directories, complete or not. The actor is saved last, so
    another role's directory of a step the actor lacks is a save that did not finish, and nothing to keep."""
    return [f"actor/{directory.name}" for _, directory in sorted(iteration_dirs(checkpoints / "actor").items())]


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown if len(names) <= NAMES_SHOWN else f"{shown} and {len(names) - NAMES_SHOWN} more"

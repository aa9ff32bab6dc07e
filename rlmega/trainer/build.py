"""Starting a run's parts on Ray and handing them to the ``Trainer`` whole.

    trainer = build_trainer(config)      # where it resumes; reward model / judge, prompts, teachers, ranks, engines, ...
    exit_code = trainer.fit()
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rlmega.config.schema import RLConfig
from rlmega.data import PromptDatasets
from rlmega.errors import RunFailure
from rlmega.trainer.cluster import disconnect
from rlmega.trainer.controller import Trainer, export_hf
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.resume import decide_resume
from rlmega.trainer.roles import role_groups
from rlmega.trainer.warm_start import supervised_warm_start


def build_trainer(config: RLConfig, datasets: Optional[PromptDatasets] = None) -> Trainer:
    """Every part of the run described by ``config``, started and wired; nothing is left running if
    one of them fails to start. Where it starts (``resume``) is decided first, before anything starts.
    ``datasets``: the prompts as ``rlmega.config.validate`` read them (None: read here)."""
    from rlmega.trainer.cluster import start_reward_workers, start_teachers, start_workers

    start = decide_resume(config)
    reward_model, judge, reward_placement = start_reward_workers(config)
    try:
        prompts = build_prompt_side(config, datasets, reward_model=reward_model, judge=judge)  # owns them now
    except BaseException:
        for part in (reward_model, judge):
            if part is not None:
                part.shutdown()
        raise
    try:
        teachers, teacher_placement = start_teachers(config)
    except BaseException:
        prompts.close()
        raise
    try:
        job, engines, placement = start_workers(config)
    except BaseException:
        if teachers is not None:
            teachers.shutdown()
        prompts.close()
        raise
    try:
        run_dir = Path(config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "placement.json").write_text(json.dumps({**placement, **reward_placement, **teacher_placement},
                                                           indent=1))
        actor, reference, critic = role_groups(job, reference=config.needs_reference, critic=config.needs_critic)
        return Trainer(config, prompts, job, actor, engines, reference=reference, critic=critic, teachers=teachers,
                       start=start)
    except BaseException:
        engines.shutdown()
        job.shutdown()
        if teachers is not None:
            teachers.shutdown()
        prompts.close()
        raise


def run(config: RLConfig, datasets: Optional[PromptDatasets] = None) -> int:
    """``rlmega train``: the whole run; the process exit code. ``datasets``: the prompts as ``rlmega.config.validate``
    read them (None: read here). A run that fails before its first step leaves the run directory as it found it
    (no placement.json, no empty metrics.jsonl), but for its new logs, kept in ``logs/failed-start-<time>/``."""
    run_dir = Path(config.run_dir)
    before = set(run_dir.iterdir()) if run_dir.is_dir() else None
    trainer = None
    try:
        trainer = build_trainer(config, datasets)
        return trainer.fit()
    except BaseException as error:
        logs = run_dir / "logs"
        if isinstance(error, RunFailure):
            error.details = _write_traceback(error, logs / "error.log")
        if trainer is None or trainer.steps_done == 0:
            kept = _keep_new_logs(logs, before)
            _remove_what_was_written(run_dir, before, keep=logs if kept else None)
            if kept and isinstance(error, RunFailure):
                error.relocate(str(logs), kept)
            elif kept:
                error.add_note(f"the workers' output is in {kept}")
        raise
    finally:
        disconnect()


def _write_traceback(error: BaseException, path: Path) -> str | None:
    import traceback

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return str(path)


def _keep_new_logs(logs: Path, before) -> str | None:
    """A start that failed leaves the run directory as it was, but for its new logs (the workers' output, the
    traceback), which are what the user needs: they move into ``logs/failed-start-<time>/`` (returned), so that the
    next run's logs start afresh beside them and nothing is left outside the run directory."""
    import shutil
    import time

    if not logs.is_dir() or (before is not None and logs in before):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = logs / f"failed-start-{stamp}"
    suffix = 1
    while kept.exists():
        suffix += 1
        kept = logs / f"failed-start-{stamp}-{suffix}"
    entries = [entry for entry in logs.iterdir() if not entry.name.startswith("failed-start-")]
    kept.mkdir()
    for entry in entries:
        shutil.move(str(entry), str(kept / entry.name))
    return str(kept)


def _remove_what_was_written(run_dir: Path, before, keep: Optional[Path] = None) -> None:
    """Everything in ``run_dir`` that is not in ``before`` (None: the directory did not exist), but ``keep``."""
    import shutil

    if before is None and keep is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for entry in set(run_dir.iterdir()) - (before or set()) - {keep} if run_dir.is_dir() else ():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def run_sft(config: RLConfig, datasets: Optional[PromptDatasets] = None) -> int:
    """``rlmega sft``: only the supervised warm-start (``trainer.sft_steps``), exported to ``run_dir/sft_hf``;
    ``datasets`` as for ``run``."""
    from rlmega.trainer.cluster import start_workers
    from rlmega.trainer.roles import ActorGroup

    prompts = build_prompt_side(config, datasets)
    job = None
    try:
        job, _, _ = start_workers(config, with_rollout=False)
        supervised_warm_start(ActorGroup(job), prompts.warm_start)
        root = Path(config.run_dir) / "sft_checkpoints"
        job.save(str(root), {**prompts.data.state_dict(), "step": 0})
        export_hf(root / "actor", Path(config.run_dir) / "sft_hf", config.model.path)
        return 0
    finally:
        if job is not None:
            job.shutdown()
        prompts.close()
        disconnect()

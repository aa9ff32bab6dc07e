"""The assets a run builds itself (``tiny_assets``: the quickstart's model and data, the vision-language ones, the
tiny reward model and teacher), checked before they reach the run directory: ``validate_with_assets`` builds the missing ones
in a temporary directory, runs every check of the config against them there, and moves them into
``run_dir/assets`` only once they all passed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlmega.trainer.assets import prepare_tiny_assets


def validate_with_assets(config):
    """``rlmega.config.validate(config)`` (its prompt datasets returned) for a run that may build tiny assets: the
    checks that need no files first; then any missing asset is built in a temporary directory, the rest of the
    checks read them there, and only a config that passes them all gets them moved into ``run_dir/assets``.
    Nothing is written into the run directory for a config that cannot run."""
    from rlmega.config.load import check_inputs, check_settings
    from rlmega.errors import UserError

    check_settings(config)
    if not config.tiny_assets:
        return check_inputs(config)
    assets = Path(config.run_dir) / "assets"
    with tempfile.TemporaryDirectory(prefix="rlmega-assets-") as scratch:
        staged = Path(scratch) / "assets"
        staged.mkdir()
        for entry in assets.iterdir() if assets.is_dir() else ():
            if ".tmp" not in entry.name:  # complete assets are read where they are (a .tmp one is a build cut short)
                (staged / entry.name).symlink_to(entry.resolve())
        staged_config = _with_assets_at(config, assets, staged)
        prepare_run_assets(staged_config)
        try:
            datasets = check_inputs(staged_config)
        except UserError as error:  # it names the files where they would have been
            error.args = tuple(str(arg).replace(str(staged), str(assets)) for arg in error.args)
            raise
        _move_in_new_assets(staged, assets)
        datasets.relocate(str(staged), str(assets))
        return datasets


def _with_assets_at(config, assets: Path, staged: Path):
    """A copy of ``config`` whose paths under ``assets`` lie under ``staged`` instead, with ``run_dir`` the folder
    of ``staged`` (``prepare_run_assets`` builds into ``run_dir/assets``)."""
    import copy
    import dataclasses

    old = os.path.normpath(assets)

    def moved(value):
        if isinstance(value, str):
            path = os.path.normpath(value)
            if path == old or path.startswith(old + os.sep):
                return os.path.join(staged, os.path.relpath(path, old))
            return value
        if isinstance(value, list):
            return [moved(item) for item in value]
        if isinstance(value, dict):
            return {key: moved(item) for key, item in value.items()}
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                object.__setattr__(value, field.name, moved(getattr(value, field.name)))
        return value

    copied = moved(copy.deepcopy(config))
    copied.run_dir = str(staged.parent)
    return copied


def _move_in_new_assets(staged: Path, assets: Path) -> None:
    """Every asset built in ``staged`` into ``assets``, each whole or not at all (copied beside, then renamed)."""
    import shutil

    new = [entry for entry in staged.iterdir() if not entry.is_symlink()]
    if not new:
        return
    assets.mkdir(parents=True, exist_ok=True)
    for entry in new:
        partial = assets / f"{entry.name}.tmp-move"
        if partial.is_dir():  # a move cut short
            shutil.rmtree(partial)
        partial.unlink(missing_ok=True)
        shutil.move(str(entry), str(partial))  # a rename on one file system, a copy across two
        os.replace(partial, assets / entry.name)


def prepare_run_assets(config) -> None:
    """The tiny assets ``config`` asks for under ``run_dir/assets``: the quickstart's (``tiny_assets``), or the
    vision-language ones (``tiny_vision``), the tiny reward model (``tiny_reward_model``) and the tiny teacher
    (``tiny_teacher``, at ``teacher.path``)."""
    directory = Path(config.run_dir) / "assets"
    if config.tiny_vision:
        from rlmega.trainer.vlm_assets import prepare_tiny_vlm_assets

        prepare_tiny_vlm_assets(directory)
    else:
        prepare_tiny_assets(directory, max_operand=config.tiny_assets_max_operand)
    if config.tiny_reward_model:
        from rlmega.trainer.tiny_reward_model import prepare_tiny_reward_model

        policy = config.model.tokenizer_path or config.model.path
        prepare_tiny_reward_model(config.reward_model.path, policy_dir=policy, train_files=config.data.files)
    if config.tiny_teacher:
        from rlmega.trainer.tiny_teacher import prepare_tiny_teacher

        policy = config.model.tokenizer_path or config.model.path
        prepare_tiny_teacher(config.teacher.path, policy_dir=policy, train_files=config.data.files,
                             val_files=config.val_data.files)

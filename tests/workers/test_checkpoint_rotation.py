"""Checkpoint rotation keeps exactly the newest k complete checkpoints, drops what a killed save
left, never touches the one the tracker names, and resume still finds the newest."""

import json

import pytest

from rlmega.workers.checkpoint import METADATA, TRACKER, latest_checkpoint, rotate_checkpoints


def _complete(root, step):
    directory = root / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    (directory / METADATA).write_text(json.dumps({"step": step}))
    return directory


def test_keeps_the_newest_k_complete_and_drops_partial_saves(tmp_path):
    for step in (1, 2, 3, 4):
        _complete(tmp_path, step)
    partial = tmp_path / "iter_0000005.tmp"  # a save killed halfway
    partial.mkdir()
    unfinished = tmp_path / "iter_0000006"  # renamed but never marked complete: not a checkpoint
    unfinished.mkdir()
    (tmp_path / TRACKER).write_text("4")
    removed = rotate_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002", "iter_0000005.tmp"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004", "iter_0000006"]
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"


def test_the_tracked_checkpoint_survives_even_when_older(tmp_path):
    for step in (1, 2, 3):
        _complete(tmp_path, step)
    (tmp_path / TRACKER).write_text("1")  # e.g. resumed from 1 and later saves are not tracked yet
    rotate_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001", "iter_0000003"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        rotate_checkpoints(tmp_path, keep=0)

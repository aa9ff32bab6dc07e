"""How a run decides where it starts: the newest complete checkpoint whatever the tracker file says, a refusal
for iteration directories of which none is complete, for settings that change what the checkpoints were trained
with and for a run already at its last step, and resume=never over checkpoints only with overwrite. The decision
on directories laid out by hand, then real tiny runs on the command line."""

import json
import shutil
import subprocess
import sys

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.resume import ResumeDecision, decide_resume, prepare_first_save
from rlmega.trainer.resume_settings import SETTINGS, leaf_names

from .fakes import FakeActor, FakeEngines, FakeJob, FakeReference

ONE_RANK = ["trainer.prompts_per_step=4", "rollout.n=4", "trainer.sft_steps=2", "trainer.val_every=0",
            "trainer.save_every=1", "export_hf=false", "reward.num_workers=1", "layout.tp=1", "layout.world_size=1"]
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


def _config(run_dir, *overrides):
    return load_config("tiny_cpu", [f"run_dir={run_dir}", *ONE_RANK, *overrides], check=False)


def _checkpoints(run_dir, steps, *, roles=("actor", "ref"), incomplete=(), tracker=None,
                 settings=("trainer.total_steps=5",)):
    """``run_dir/checkpoints`` as saves leave it: ``iter_*`` of each role (complete, or without ``rlmega.json``),
    the actor's tracker (``None``: none), and the settings of ``_config(run_dir, *settings)``."""
    root = run_dir / "checkpoints"
    for role in roles:
        for step in [*steps, *incomplete]:
            directory = root / role / f"iter_{step:07d}"
            directory.mkdir(parents=True)
            if step in steps:
                (directory / "rlmega.json").write_text(json.dumps({"step": step}))
    if tracker is not None:
        (root / "actor" / TRACKER).write_text(str(tracker))
    prepare_first_save(run_dir, _config(run_dir, *settings), ResumeDecision())
    return root


@pytest.mark.parametrize("tracker, reason", [
    (None, f"resuming from iter_0000003: {TRACKER} was missing"),
    (9, f"resuming from iter_0000003: {TRACKER} named iter_0000009, which is not there (actor/iter_0000009, "
        f"ref/iter_0000009 missing)"),
    (4, f"resuming from iter_0000003: {TRACKER} named iter_0000004, which is incomplete (no rlmega.json in "
        f"actor/iter_0000004, ref/iter_0000004)"),
    (2, f"resuming from iter_0000003: {TRACKER} named the older iter_0000002"),
    ("x", f"resuming from iter_0000003: {TRACKER} holds 'x', not a step"),
    (3, None),
], ids=["missing", "not-there", "incomplete", "older", "not-a-step", "agrees"])
def test_the_newest_complete_checkpoint_is_resumed_whatever_the_tracker_says(tmp_path, capsys, tracker, reason):
    _checkpoints(tmp_path, [1, 2, 3], incomplete=[4], tracker=tracker)
    assert decide_resume(_config(tmp_path, "trainer.total_steps=5")) == ResumeDecision(step=3)
    printed = capsys.readouterr().out
    if reason is None:
        assert printed == ""
    else:
        assert printed.count("\n") == 1 and printed.startswith(reason), printed


def test_a_step_is_complete_only_where_every_role_saved_it(tmp_path, capsys):
    # The critic's save of step 3 came first and finished; the actor's did not (no rlmega.json).
    root = _checkpoints(tmp_path, [1, 2], roles=("actor",), incomplete=[3], tracker=2)
    for step in (2, 3):
        (root / "critic" / f"iter_{step:07d}").mkdir(parents=True)
        (root / "critic" / f"iter_{step:07d}" / "rlmega.json").write_text("{}")
    assert decide_resume(_config(tmp_path, "trainer.total_steps=5")).step == 2
    assert capsys.readouterr().out == ""


def test_iteration_directories_of_which_none_is_complete_are_refused_by_name(tmp_path):
    _checkpoints(tmp_path, [], incomplete=[20, 40], tracker=40)
    with pytest.raises(UserError) as refused:
        decide_resume(_config(tmp_path))
    message = str(refused.value)
    assert "holds actor/iter_0000020, actor/iter_0000040 but no complete checkpoint" in message
    assert "no complete checkpoint" in message and "resume=never --overwrite" in message


def test_a_first_save_cut_before_the_actor_finished_is_no_checkpoint_to_keep(tmp_path):
    # The reference's part of step 1 was saved, the actor's (saved last) was still staging.
    root = _checkpoints(tmp_path, [1], roles=("ref",))
    (root / "actor" / "iter_0000001.tmp").mkdir(parents=True)
    assert decide_resume(_config(tmp_path)) == ResumeDecision()
    assert decide_resume(_config(tmp_path, "resume=never")) == ResumeDecision()


def test_resume_never_over_checkpoints_needs_overwrite_and_replaces_them_at_the_first_save(tmp_path):
    root = _checkpoints(tmp_path, [1, 2], tracker=2)
    with pytest.raises(UserError, match=r"resume=never would write over the checkpoints in .* \(actor/iter_0000001, "
                                        r"actor/iter_0000002\); pass --overwrite"):
        decide_resume(_config(tmp_path, "resume=never"))
    with pytest.raises(UserError, match=r"overwrite=true \(--overwrite\) replaces checkpoints only for a run "
                                        r"started afresh, .* add resume=never"):
        decide_resume(_config(tmp_path, "overwrite=true"))
    assert sorted(p.name for p in (root / "actor").iterdir()) == ["iter_0000001", "iter_0000002", TRACKER]
    config = _config(tmp_path, "resume=never", "overwrite=true")
    decision = decide_resume(config)
    assert decision == ResumeDecision(step=0, replaces_checkpoints=True)
    prepare_first_save(tmp_path, config, decision)
    assert sorted(p.name for p in root.iterdir()) == ["config.yaml"]
    # With nothing there, resume=never starts afresh without being told more.
    assert decide_resume(_config(tmp_path / "new", "resume=never")) == ResumeDecision()


def test_settings_that_change_what_is_trained_are_refused_naming_each(tmp_path):
    _checkpoints(tmp_path, [1, 2], tracker=2)
    with pytest.raises(UserError) as refused:
        decide_resume(_config(tmp_path, "trainer.total_steps=1", "algo=dapo", "actor.optimizer.lr=1e-3"))
    message = str(refused.value)
    for change in ("algorithm.dynamic_sampling: false -> true", "actor.policy_loss.clip_ratio_high: null -> 0.28",
                   "actor.policy_loss.kl_loss_coef: 0.001 -> 0.0", "actor.optimizer.lr: 0.0005 -> 0.001"):
        assert change in message, message
    assert "use another run_dir" in message and "resume=never --overwrite" in message
    assert "total_steps" not in message  # what may change is not among the refused


def test_settings_that_may_change_are_listed_on_one_line(tmp_path, capsys):
    _checkpoints(tmp_path, [1, 2], tracker=2)
    config = _config(tmp_path, "trainer.total_steps=6", "metrics.backends=[jsonl]", "trainer.val_every=2",
                     "layout.tp=2", "layout.world_size=2", "rollout.placement=disaggregated")
    assert decide_resume(config) == ResumeDecision(step=2)
    assert capsys.readouterr().out == (
        "resuming with changed settings: layout.tp: 1 -> 2, layout.world_size: 1 -> 2, "
        "rollout.placement: colocated -> disaggregated, trainer.total_steps: 5 -> 6, trainer.val_every: 0 -> 2, "
        'metrics.backends: ["console", "jsonl"] -> ["jsonl"]\n')


def test_checkpoints_without_their_settings_resume_saying_so(tmp_path, capsys):
    root = _checkpoints(tmp_path, [1, 2], tracker=2)
    (root / "config.yaml").unlink()
    assert decide_resume(_config(tmp_path, "trainer.total_steps=5", "algo=dapo")).step == 2
    assert capsys.readouterr().out == f"resuming without comparing settings: {root / 'config.yaml'} is missing\n"
    (root / "config.yaml").write_text("{unclosed")
    with pytest.raises(UserError, match=r"config.yaml does not hold the settings of a run; restore it, or delete it"):
        decide_resume(_config(tmp_path, "trainer.total_steps=5"))


def test_a_run_past_its_last_step_is_refused_and_one_at_it_finishes(tmp_path, capsys):
    _checkpoints(tmp_path, [1, 2], tracker=2, settings=["trainer.total_steps=2"])
    with pytest.raises(UserError, match=r"already reached step 2, and trainer.total_steps=1 asks for "
                                        r"1 steps in all: nothing is left to train; raise "
                                        r"trainer.total_steps .* or use another run_dir"):
        decide_resume(_config(tmp_path, "trainer.total_steps=1"))
    # Requeued after a SIGTERM in its last step: it finishes (the export) instead of failing.
    capsys.readouterr()
    assert decide_resume(_config(tmp_path, "trainer.total_steps=2")).step == 2
    assert "already reached its last step 2: nothing to train, finishing" in capsys.readouterr().out


def test_a_run_of_epochs_past_its_last_step_is_refused_by_the_trainer(tmp_path, assets):
    # 64 prompts, 4 a step: one epoch is 16 steps, known only once the data is read.
    (tmp_path / "assets").symlink_to(assets)
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", *ONE_RANK, "trainer.total_epochs=1",
                                      f"data.files=['{assets / 'train.parquet'}']", "metrics.backends=[jsonl]"])
    prompts = build_prompt_side(config)
    engines = FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])
    try:
        with pytest.raises(UserError, match=r"already reached step 17, and trainer.total_epochs=1 asks for 16 steps"):
            Trainer(config, prompts, FakeJob(), FakeActor(), engines, reference=FakeReference(),
                    start=ResumeDecision(step=17))
    finally:
        prompts.close()


def test_a_moved_run_directory_is_the_same_run(tmp_path, capsys):
    _checkpoints(tmp_path / "before", [1, 2], tracker=2)  # model.path and data.files lie under run_dir
    shutil.move(tmp_path / "before", tmp_path / "after")
    assert decide_resume(_config(tmp_path / "after", "trainer.total_steps=5")).step == 2
    assert capsys.readouterr().out == ""


def test_every_setting_has_an_entry_in_the_table_and_every_entry_a_setting():
    names = leaf_names(_config("runs/x"))
    prefixes = {".".join(name.split(".")[:n]) for name in names for n in range(1, name.count(".") + 2)}
    assert not [name for name in names if not any(".".join(name.split(".")[:n]) in SETTINGS
                                                  for n in range(1, name.count(".") + 2))]
    assert not [entry for entry in SETTINGS if entry not in prefixes]  # a misspelt entry would classify nothing


# ---- real tiny runs on the command line ---------------------------------------------------------------------


def _train(run_dir, *overrides):
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *ONE_RANK, *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _files(run_dir, pattern="*"):
    """The files under ``run_dir/checkpoints`` as they are (a save replaces a directory whole, so a rewritten
    file is a new one)."""
    return {str(path.relative_to(run_dir)): (path.stat().st_ino, path.stat().st_mtime_ns)
            for path in sorted((run_dir / "checkpoints").glob(pattern)) if path.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, assets):
    """A two-step run, checkpointed at both steps."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_dir.mkdir()
    (run_dir / "assets").symlink_to(assets)
    result = _train(run_dir, "trainer.total_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _copy(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, symlinks=True)
    return run_dir


def test_a_run_without_its_tracker_file_resumes_from_its_newest_checkpoint_and_keeps_them(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    (run_dir / "checkpoints" / "actor" / TRACKER).unlink()
    before = _files(run_dir, "*/iter_*/*")
    result = _train(run_dir, "trainer.total_steps=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from iter_0000002: {TRACKER} was missing\n" in result.stdout
    assert "resuming with changed settings: trainer.total_steps: 2 -> 3\n" in result.stdout
    assert "warm-start" not in result.stdout
    after = _files(run_dir, "*/iter_*/*")
    assert len(before) > 10 and {name: after[name] for name in before} == before  # steps 1 and 2 as they were
    assert (run_dir / "checkpoints" / "actor" / TRACKER).read_text() == "3"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]


def test_a_changed_run_or_resume_never_over_it_is_refused_and_keeps_its_checkpoints(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    before = _files(run_dir, "**/*")
    for overrides, says in [
        (["trainer.total_steps=1", "algo=dapo"], "were trained with other settings: actor.policy_loss.clip_ratio_low: "
                                                 "null -> 0.2"),
        (["trainer.total_steps=3", "resume=never"], "resume=never would write over the checkpoints"),
    ]:
        result = _train(run_dir, *overrides)
        assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
        assert result.stderr.startswith("rlmega train: ") and result.stderr.count("\n") == 1, result.stderr[-3000:]
        assert says in result.stderr, result.stderr
        assert _files(run_dir, "**/*") == before
    replaced = _train(run_dir, "resume=never", "--overwrite", "trainer.total_steps=1")  # overrides on both sides
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "warm-start" in replaced.stdout and "resumed from" not in replaced.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints" / "actor").iterdir()) == ["iter_0000001", TRACKER]
    assert "overwrite: true" in (run_dir / "checkpoints" / "config.yaml").read_text()

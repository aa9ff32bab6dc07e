"""User reward functions in the worker pool: good, failing, hanging and crashing calls, clean-up, and metrics."""

import os
import time

import pytest

from rlmega.rewards import RewardConfig, RewardScorer, ScoreItem, as_score

USER_FILE = os.path.join(os.path.dirname(__file__), "user_rewards.py")


def _scorer(name, num_workers=2, timeout_s=1.0):
    return RewardScorer(RewardConfig(user_function=f"{USER_FILE}:{name}", num_workers=num_workers,
                                     timeout_s=timeout_s))


def _items(*responses, ground_truth="42", extra_info=None):
    return [ScoreItem("my/task", response, ground_truth, extra_info) for response in responses]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is dead too
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_good_function_scores_in_order():
    with _scorer("compute_score") as scorer:
        scores, metrics = scorer.score_batch(_items("42", " 42\n", "41", "", "42"))
    assert scores == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/mean": 0.6, "reward/errors": 0.0, "reward/timeouts": 0.0}


def test_dict_result_gives_score_and_numeric_extras_as_metrics():
    with _scorer("with_metrics") as scorer:
        scores, metrics = scorer.score_batch(_items("42", "4"))
        outcomes = scorer.score_items(_items("42"))
    assert scores == [1.0, 0.0]
    assert metrics["reward/extra/length"] == 1.5 and "reward/extra/note" not in metrics
    assert outcomes[0].status == "ok" and outcomes[0].extras == {"length": 2.0}


def test_exceptions_and_bad_returns_score_zero_and_are_counted():
    with _scorer("raises") as scorer:
        scores, metrics = scorer.score_batch(_items("boom", "fine", "boom"))
        outcome = scorer.score_items(_items("boom"))[0]
    assert scores == [0.0, 1.0, 0.0] and metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 0.0
    assert outcome.status == "error" and "RuntimeError: user function failed on purpose" in outcome.message
    with _scorer("returns_garbage") as scorer:
        scores, metrics = scorer.score_batch(_items("dict", "str"))
    assert scores == [0.0, 0.0] and metrics["reward/errors"] == 2.0


def test_function_sleeping_forever_times_out_without_stalling_the_batch():
    with _scorer("sleeps_forever", num_workers=2, timeout_s=1.0) as scorer:
        started = time.monotonic()
        scores, metrics = scorer.score_batch(_items("sleep", "a", "b", "sleep", "c", "d"))
        elapsed = time.monotonic() - started
        assert scores == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
        assert metrics["reward/timeouts"] == 2.0 and metrics["reward/errors"] == 0.0
        assert elapsed < 4.0  # two hanging calls on two workers: about one timeout, plus a worker restart
        scores, metrics = scorer.score_batch(_items("a", "b", "c"))  # replaced workers keep scoring
        assert scores == [1.0, 1.0, 1.0] and metrics["reward/timeouts"] == 0.0


def test_timeout_also_kills_processes_the_function_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    with _scorer("starts_a_child_then_sleeps", num_workers=1, timeout_s=1.0) as scorer:
        scores, metrics = scorer.score_batch(_items("x", extra_info={"pid_file": str(pid_file)}))
    assert scores == [0.0] and metrics["reward/timeouts"] == 1.0
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_worker_that_dies_is_counted_and_replaced():
    with _scorer("exits_the_process", num_workers=1) as scorer:
        scores, metrics = scorer.score_batch(_items("ok", "exit", "ok"))
    assert scores == [1.0, 0.0, 1.0] and metrics["reward/errors"] == 1.0


def test_close_ends_every_worker():
    scorer = _scorer("worker_pid", num_workers=2)
    scores, _ = scorer.score_batch(_items("a", "b", "c", "d"))
    pids = {int(score) for score in scores}
    assert pids and all(_alive(pid) for pid in pids)
    scorer.close()
    scorer.close()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score_batch(_items("a"))


@pytest.mark.parametrize("spec, message", [
    ("no_colon.py", "must be given as 'path/to/file.py:function_name'"),
    ("file.txt:fn", "must be given as"),
    ("/does/not/exist.py:fn", "file not found: /does/not/exist.py"),
])
def test_bad_specs_are_refused_at_config_time(spec, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(user_function=spec)


def test_a_missing_function_is_named_without_running_the_file(tmp_path):
    from rlmega.errors import UserError
    from rlmega.rewards.user_function import check_function_defined

    source = tmp_path / "scores.py"
    source.write_text("raise SystemExit('ran')\ntry:\n    def fast():\n        pass\nexcept ImportError:\n"
                      "    fast = None\n\nasync def slow():\n    pass\n")
    check_function_defined(f"{source}:fast")
    with pytest.raises(UserError) as error:
        check_function_defined(f"{source}:score")
    assert str(error.value) == (f"reward.user_function={source}:score: {source} has no function score "
                                "(it defines: fast, slow)")


def test_missing_function_fails_when_the_workers_load_it():
    with pytest.raises(ValueError, match="defines no callable named 'not_callable'"):
        _scorer("not_callable", num_workers=1)


def test_a_file_that_fails_to_import_is_reported(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency xyz')\n")
    with pytest.raises(ValueError, match="missing dependency xyz"):
        RewardScorer(RewardConfig(user_function=f"{broken}:compute_score", num_workers=1))


def test_rules_in_workers_match_rules_in_process():
    items = [ScoreItem("openai/gsm8k", "#### 8", "8"), ScoreItem("countdown", "<answer>1+2</answer>",
                                                                   {"target": 3, "numbers": [1, 2]}),
             ScoreItem("lighteval/MATH", r"\boxed{\frac12}", "0.5"), ScoreItem("openai/gsm8k", "8", "8")]
    in_process = RewardScorer().score_batch(items)
    with RewardScorer(RewardConfig(rules_in_workers=True, num_workers=2)) as scorer:
        assert scorer.score_batch(items) == in_process
    assert in_process[0] == [1.0, 1.0, 1.0, 0.0]


def test_items_from_prompt_records(tmp_path):
    from rlmega.data import DataConfig, PromptDataset, build_char_tokenizer, write_arithmetic_dataset

    path = write_arithmetic_dataset(tmp_path / "train.parquet", num_rows=4, seed=0)
    records = PromptDataset(DataConfig(files=[path]), build_char_tokenizer()).records
    responses = [record.ground_truth if index % 2 == 0 else "-1" for index, record in enumerate(records)]
    items = [ScoreItem.from_record(record, response) for record, response in zip(records, responses)]
    assert items[0].extra_info == records[0].extra_info
    assert RewardScorer().score_batch(items)[0] == [1.0, 0.0, 1.0, 0.0]


def test_unknown_data_source_is_a_configuration_error():
    with pytest.raises(ValueError, match=r"no rule scorer for data_source 'my/task'; valid: \["):
        RewardScorer().score_batch(_items("42"))
    with _scorer("compute_score", num_workers=1) as scorer:
        scorer.check_data_sources(["my/task"])  # a user function takes every data source


def test_rule_scorer_errors_in_process_are_counted():
    scores, metrics = RewardScorer().score_batch([ScoreItem("countdown", "<answer>1</answer>", "not a dict")])
    assert scores == [0.0] and metrics["reward/errors"] == 1.0


def test_as_score_conversion():
    assert as_score(True) == (1.0, {})
    assert as_score({"score": 0.5, "acc": 1, "pred": "7"}) == (0.5, {"acc": 1.0})
    for bad in ({"acc": 1.0}, float("nan"), None, "1.0"):
        with pytest.raises(TypeError):
            as_score(bad)

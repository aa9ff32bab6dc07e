"""The trainer's metrics tracker: jsonl rows and resume, console lines, PNG, TensorBoard, W&B/MLflow glue, batch_metrics."""

import ast
import io
import json
import math
import sys
import types

import pytest
import torch

from rlmega.trainer import metric_backends
from rlmega.trainer import metrics as metrics_mod
from rlmega.trainer import plots
from rlmega.trainer.metrics import MetricsConfig, MetricsTracker, batch_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tracker(run_dir, backends=("jsonl",), **kwargs):
    return MetricsTracker(run_dir, MetricsConfig(backends=list(backends), plot=False), **kwargs)


def _run_steps(tracker, steps, val_every=2):
    for step in steps:
        tracker.log(step, {"critic/score/mean": step / 10, "actor/pg_loss": -step})
        if step % val_every == 0:
            tracker.log_validation(step, {"val/accuracy": step / 20})


def test_jsonl_rows_one_per_step_plus_validation(tmp_path):
    with _tracker(tmp_path) as tracker:
        with tracker.phase("gen"):
            pass
        with tracker.phase("gen"):
            pass
        tracker.log(1, {"critic/score/mean": torch.tensor(0.25), "actor/entropy": float("nan"), "flag": True})
        tracker.log_validation(1, {"accuracy": 0.5})
        tracker.log(2, {"critic/score/mean": 0.5})
        assert [r["step"] for r in _rows(tmp_path)] == [1, 1, 2]  # flushed before close
    train1, val1, train2 = _rows(tmp_path)
    assert train1["critic/score/mean"] == 0.25
    assert train1["actor/entropy"] is None  # NaN -> null: every line is strict JSON
    assert train1["flag"] == 1 and type(train1["flag"]) is int
    assert train1["timing_s/gen"] >= 0
    assert val1 == {"step": 1, "val/accuracy": 0.5}  # prefix added
    assert "timing_s/gen" not in train2  # phases go into the next row only


def test_explicit_timing_wins_over_phase(tmp_path):
    with _tracker(tmp_path) as tracker:
        with tracker.phase("gen"):
            pass
        tracker.log(1, {"timing_s/gen": 3.0})
    assert _rows(tmp_path)[0]["timing_s/gen"] == 3.0


def test_non_scalar_metric_is_rejected_with_its_name(tmp_path):
    with _tracker(tmp_path) as tracker:
        with pytest.raises(TypeError, match="actor/pg_loss"):
            tracker.log(1, {"actor/pg_loss": torch.zeros(3)})
        with pytest.raises(TypeError, match="note"):
            tracker.log(1, {"note": "hello"})


def test_resume_drops_rows_after_the_resume_step_and_appends(tmp_path):
    tracker = _tracker(tmp_path)
    _run_steps(tracker, range(1, 6))  # steps 1..5, validations at 2 and 4; then the run dies
    tracker.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "critic/sc')  # torn last line
    with pytest.warns(UserWarning, match="not JSON"):
        tracker = _tracker(tmp_path, resume_step=3)
    assert [(r["step"], "val/accuracy" in r) for r in _rows(tmp_path)] == [(1, False), (2, False), (2, True), (3, False)]
    _run_steps(tracker, range(4, 6))
    tracker.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if "val/accuracy" not in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "val/accuracy" in r] == [2, 4]


def test_new_run_replaces_an_existing_file(tmp_path):
    with _tracker(tmp_path) as tracker:
        _run_steps(tracker, range(1, 4))
    with _tracker(tmp_path) as tracker:
        tracker.log(1, {"critic/score/mean": 1.0})
    assert _rows(tmp_path) == [{"step": 1, "critic/score/mean": 1.0}]


def test_resume_step_zero_keeps_validation_before_training(tmp_path):
    with _tracker(tmp_path) as tracker:
        tracker.log_validation(0, {"val/accuracy": 0.1})
        tracker.log(1, {"critic/score/mean": 0.2})
    with _tracker(tmp_path, resume_step=0):
        pass
    assert _rows(tmp_path) == [{"step": 0, "val/accuracy": 0.1}]


def test_console_plain_lines_show_step_progress_and_key_metrics(tmp_path, capsys):
    step_metrics = {
        "critic/score/mean": 0.41234, "response_length/mean": 312.5, "response_length/clip_ratio": 0.0625,
        "actor/pg_loss": -0.0123456, "actor/entropy": 0.87312, "actor/kl_loss": 0.00123456,
        "actor/grad_norm": 0.45, "actor/lr": 1e-6, "timing_s/step": 3.214, "timing_s/gen": 2.1,
        "some/other": 7.0,
    }
    config = MetricsConfig(backends=["console"], console_every=2, plot=False, project="math", experiment_name="grpo-7b")
    with MetricsTracker(tmp_path, config, total_steps=10) as tracker:
        for step in (1, 2, 3):
            tracker.log(step, step_metrics)
        tracker.log_validation(3, {"val/accuracy": 0.35})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # the run's name, step 1 (first), step 2 (every 2), the validation; not step 3
    name, first, second, val = lines
    assert name == "rlmega run math/grpo-7b"
    assert first.startswith("[step 1/10 ") and "eta" in first
    assert "[step 2/10 ####" in second and "20%" in second
    for text in ("score 0.4123", "len 312.5", "clip 0.0625", "pg_loss -0.01235", "entropy 0.8731",
                 "kl 0.001235", "gnorm 0.45", "lr 1e-06", "time 3.21s (gen 2.10s)"):
        assert text in second, text
    assert "other" not in second
    assert val == "[val @ step 3] accuracy 0.35"


def test_console_on_a_terminal_uses_a_live_bar(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.delenv("TERM", raising=False)
    with MetricsTracker(tmp_path, MetricsConfig(backends=["console"], plot=False), total_steps=4) as tracker:
        tracker.log(1, {"critic/score/mean": 0.5})
    assert "step 1/4 score 0.5" in terminal.getvalue()


def test_reward_curve_png(tmp_path):
    pytest.importorskip("matplotlib")
    tracker = MetricsTracker(tmp_path, MetricsConfig(backends=["jsonl"]))
    _run_steps(tracker, range(1, 5))
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == PNG_MAGIC  # redrawn at each validation
    (tmp_path / "reward_curve.png").unlink()
    tracker.close()
    from matplotlib.image import imread

    image = imread(tmp_path / "reward_curve.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_reward_curve_includes_rows_from_before_a_resume(tmp_path):
    pytest.importorskip("matplotlib")
    with _tracker(tmp_path) as tracker:
        _run_steps(tracker, range(1, 5))
    tracker = MetricsTracker(tmp_path, MetricsConfig(backends=["jsonl"]), resume_step=2)
    assert tracker._train_score == [(1, 0.1), (2, 0.2)] and tracker._val == {"val/accuracy": [(2, 0.1)]}
    tracker.close()


def test_missing_matplotlib_skips_the_plot_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning, match="pip install matplotlib"):
        tracker = MetricsTracker(tmp_path, MetricsConfig(backends=["jsonl"]))
    _run_steps(tracker, range(1, 3))
    tracker.close()
    assert not (tmp_path / "reward_curve.png").exists()


def test_tensorboard_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = MetricsTracker(tmp_path, MetricsConfig(backends=["tensorboard"], plot=False),
                             run_config={"algo": {"name": "grpo"}})
    _run_steps(tracker, range(1, 3))
    tracker.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    scores = accumulator.Scalars("critic/score/mean")
    assert [(e.step, round(e.value, 6)) for e in scores] == [(1, 0.1), (2, 0.2)]
    assert [e.step for e in accumulator.Scalars("val/accuracy")] == [2]


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])
def test_missing_optional_backend_names_the_install_command(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # makes `import <backend>` fail
    run_dir = tmp_path / "run"
    with pytest.raises(ImportError, match=f"pip install {backend}"):
        MetricsTracker(run_dir, MetricsConfig(backends=["jsonl", backend]))
    assert not run_dir.exists()  # failed before touching any file


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        MetricsConfig(backends=["console", "neptune"])
    for name in ("neptune", "console", "jsonl", "tensorboard", "wandb", "mlflow"):
        assert name in str(error.value)
    with pytest.raises(ValueError, match="console_every"):
        MetricsConfig(console_every=0)


def _fake_wandb(calls):
    class Run:
        def log(self, metrics, step):
            calls.append(("log", step, dict(metrics)))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    return types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc123"))


def test_wandb_backend_logs_and_resumes_the_same_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    config = MetricsConfig(backends=["wandb"], project="p", experiment_name="e", plot=False)
    with MetricsTracker(tmp_path, config, run_config={"lr": 1e-6}) as tracker:
        tracker.log(1, {"actor/pg_loss": 0.5})
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    with MetricsTracker(tmp_path, config, resume_step=1):
        pass
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0] == {"project": "p", "name": "e", "id": "abc123", "resume": "allow", "dir": str(tmp_path),
                        "config": {"lr": 1e-6}}
    assert inits[1]["id"] == "abc123"
    assert ("log", 1, {"actor/pg_loss": 0.5}) in calls and calls.count(("finish",)) == 2


def test_mlflow_backend_logs_params_once_and_sanitizes_names(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda **kw: calls.append(("start", kw)) or types.SimpleNamespace(
            info=types.SimpleNamespace(run_id=kw.get("run_id", "run-1"))),
        log_params=lambda params: calls.append(("params", params)),
        log_metrics=lambda metrics, step: calls.append(("metrics", step, metrics)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    config = MetricsConfig(backends=["mlflow"], project="p", experiment_name="e", plot=False)
    with MetricsTracker(tmp_path, config, run_config={"algo": {"name": "grpo", "kl": 0.1}}) as tracker:
        tracker.log_validation(3, {"val/acc@8": 0.5})
    with MetricsTracker(tmp_path, config, run_config={"algo": {"name": "grpo"}}, resume_step=3):
        pass
    assert calls[:3] == [("experiment", "p"), ("start", {"run_name": "e"}),
                         ("params", {"algo.name": "grpo", "algo.kl": "0.1"})]
    assert ("metrics", 3, {"val/acc_8": 0.5}) in calls
    assert ("start", {"run_id": "run-1"}) in calls and sum(c[0] == "params" for c in calls) == 1


def test_batch_metrics_hand_computed():
    scores = [1.0, 0.0, 0.5, 0.5]
    lengths = [4, 2, 3, 1]
    advantages = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                               [-1.0, -3.0, 99.0, 99.0],  # columns past the length are padding
                               [0.5, 0.5, 0.5, 99.0],
                               [6.0, 99.0, 99.0, 99.0]])
    # A 4-token response that ended with its stop token is not truncated: only the engine's finish reason counts.
    out = batch_metrics(scores, lengths, truncated=[False, True, False, False], advantages=advantages,
                        rewards=[0.9, -0.1, 0.4, 0.5], prompt_lengths=[7, 9, 8, 8])
    expected = {
        "critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": 0.425, "critic/rewards/max": 0.9, "critic/rewards/min": -0.1,
        # valid tokens: 1 2 3 4 | -1 -3 | .5 .5 .5 | 6 -> sum 13.5 over 10
        "critic/advantages/mean": 1.35, "critic/advantages/max": 6.0, "critic/advantages/min": -3.0,
        "response_length/mean": 2.5, "response_length/max": 4.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 0.25,
        "prompt_length/mean": 8.0, "prompt_length/max": 9.0, "prompt_length/min": 7.0,
    }
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(out[key], value, abs_tol=1e-12), (key, out[key])


def test_batch_metrics_mask_with_holes_and_sequence_advantages():
    advantages = torch.tensor([[1.0, 50.0, 3.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    out = batch_metrics(torch.tensor([1.0, 0.0]), torch.tensor([3, 3]), [False, False], advantages, response_mask=mask)
    assert out["critic/advantages/mean"] == 2.0 and out["critic/advantages/max"] == 3.0
    assert out["response_length/clip_ratio"] == 0.0
    out = batch_metrics([1.0, 0.0], [3, 3], [False, False], advantages=[0.5, -0.5])
    assert out["critic/advantages/mean"] == 0.0 and out["critic/advantages/min"] == -0.5
    with pytest.raises(ValueError, match="empty"):
        batch_metrics([], [], [])
    with pytest.raises(ValueError, match=r"\[B\]"):
        batch_metrics([1.0, 2.0], [3], [False])


def test_metrics_modules_import_neither_megatron_nor_ray():
    for module in (metrics_mod, metric_backends, plots):
        tree = ast.parse(open(module.__file__).read())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name.split(".")[0] for name in imported} & {"megatron", "ray"}, module.__name__


SAMPLES = [{"prompt": "3+5=", "response": "8", "ground_truth": "8", "score": 1.0},
           {"prompt": "2|2=", "response": "4\nok", "ground_truth": "4", "score": 0.0}]


def test_validation_samples_reach_every_backend(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    calls = []
    wandb = _fake_wandb(calls)
    wandb.Table = lambda columns, data: ("table", tuple(columns), [tuple(row) for row in data])
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    mlflow = types.SimpleNamespace(
        set_experiment=lambda name: None, log_params=lambda params: None, end_run=lambda: None,
        start_run=lambda **kw: types.SimpleNamespace(info=types.SimpleNamespace(run_id="run-1")),
        log_metrics=lambda metrics, step: None,
        log_table=lambda data, artifact_file: calls.append(("mlflow_table", artifact_file, data)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    config = MetricsConfig(backends=["console", "jsonl", "tensorboard", "wandb", "mlflow"], plot=False)
    with MetricsTracker(tmp_path, config) as tracker:
        tracker.log_generations(4, SAMPLES)
    console = capsys.readouterr().out
    assert "[val @ step 4] sample 1: '3+5=' -> '8' (expected '8', score 1)" in console
    assert "sample 2: '2|2=' -> '4\\nok'" in console
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, **sample} for sample in SAMPLES]
    columns = ("prompt", "response", "ground_truth", "score")
    table = ("table", columns, [("3+5=", "8", "8", 1.0), ("2|2=", "4\nok", "4", 0.0)])
    assert ("log", 4, {"val/generations": table}) in calls
    assert ("mlflow_table", "val_generations/step_0000004.json",
            {"prompt": ["3+5=", "2|2="], "response": ["8", "4\nok"], "ground_truth": ["8", "4"],
             "score": [1.0, 0.0]}) in calls
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (event,) = accumulator.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "| 3+5= | 8 | 8 | 1.0 |" in text and "| 2\\|2= | 4<br>ok | 4 | 0.0 |" in text


def test_generations_file_follows_the_resume_rule(tmp_path):
    with _tracker(tmp_path) as tracker:
        tracker.log_generations(2, SAMPLES[:1])
        tracker.log_generations(4, SAMPLES[:1])
    with _tracker(tmp_path, resume_step=2) as tracker:  # the run resumes after step 2: step 4's rows go
        tracker.log_generations(3, SAMPLES[1:])
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [(row["step"], row["prompt"]) for row in rows] == [(2, "3+5="), (3, "2|2=")]
    with pytest.raises(ValueError, match="missing score"):
        _tracker(tmp_path / "other").log_generations(1, [{"prompt": "a", "response": "b", "ground_truth": "c"}])

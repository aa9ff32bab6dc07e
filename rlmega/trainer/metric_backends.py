"""Where the trainer's metrics go: the console (progress bar and readable lines), ``metrics.jsonl``,
TensorBoard, Weights & Biases and MLflow. ``rlmega.trainer.metrics.MetricsTracker`` drives them;
the optional ones are imported only when asked for.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from rlmega.config.schema import MetricsConfig

JSONL_NAME = "metrics.jsonl"
GENERATIONS_NAME = "generations.jsonl"
GENERATION_COLUMNS = ("prompt", "response", "ground_truth", "score")
"""The fields of each logged validation sample (``trainer.log_val_generations``)."""
PLOT_NAME = "reward_curve.png"
TENSORBOARD_DIR = "tensorboard"
SCORE_KEY = "critic/score/mean"
RESPONSE_LENGTH_KEY = "response_length/mean"
VAL_PREFIX = "val/"
TIMING_PREFIX = "timing_s/"

# (module to import, pip package) of each optional backend.
OPTIONAL_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                      "mlflow": ("mlflow", "mlflow")}


class MetricsBackend(Protocol):
    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None: ...

    def log_generations(self, step: int, samples: list[dict]) -> None:
        """Validation samples after step ``step``: dicts with the ``GENERATION_COLUMNS``."""

    def close(self) -> None: ...


def require_package(backend: str) -> None:
    """Import the package an optional backend needs, or fail with the command that installs it."""
    module, package = OPTIONAL_PACKAGES[backend]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ImportError(f"metrics backend '{backend}' needs the '{package}' package: pip install {package}") from None


def as_number(key: str, value: Any) -> float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if hasattr(value, "item"):  # torch / numpy scalars
        try:
            return value.item()
        except (ValueError, RuntimeError):
            raise TypeError(f"metric '{key}' must be a scalar, got a value of shape {tuple(value.shape)}") from None
    raise TypeError(f"metric '{key}' must be a number, got {type(value).__name__}")


def _format_number(value: float, digits: int = 4) -> str:
    """``digits`` significant digits; integers as integers; large values without an exponent."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(int(value))
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    if 10 ** digits <= abs(value) < 1e15:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _format_seconds(seconds: float) -> str:
    """Phase timings: 0.01 s resolution under 10 s, then fewer decimals."""
    if not math.isfinite(seconds):
        return f"{seconds}s"
    decimals = 2 if abs(seconds) < 10 else 1 if abs(seconds) < 100 else 0
    return f"{seconds:.{decimals}f}s"


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


# Metrics the console shows, in order, under a short label. Others are in the other backends only.
_CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("critic/rewards/mean", "reward"),
    ("response_length/mean", "len"),
    ("response_length/clip_ratio", "clip"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/kl_loss", "kl"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/pg_clipfrac", "clipfrac"),
    ("actor/grad_norm", "gnorm"),
    ("actor/lr", "lr"),
    ("critic/vf_loss", "vf_loss"),
    ("perf/throughput", "tok/s"),
)
_MAX_CONSOLE_VAL = 8


def format_step_metrics(metrics: Mapping[str, float]) -> str:
    """The console's metric text for one training step: key metrics, then timings."""
    parts = []
    for key, label in _CONSOLE_KEYS:
        if key not in metrics:
            continue
        if key == "critic/rewards/mean" and metrics.get(SCORE_KEY) == metrics[key]:
            continue  # rewards equal scores unless a KL penalty is in the reward
        parts.append(f"{label} {_format_number(metrics[key])}")
    timings = {k[len(TIMING_PREFIX):]: v for k, v in metrics.items() if k.startswith(TIMING_PREFIX)}
    if timings:
        total = timings.pop("step", None)
        phases = " ".join(f"{name} {_format_seconds(v)}" for name, v in timings.items())
        if total is None:
            parts.append(f"time {phases}")
        else:
            parts.append(f"time {_format_seconds(total)}" + (f" ({phases})" if phases else ""))
    return " | ".join(parts)


def format_validation_metrics(metrics: Mapping[str, float]) -> str:
    names = list(metrics)
    shown = " | ".join(
        f"{k[len(VAL_PREFIX):] if k.startswith(VAL_PREFIX) else k} {_format_number(metrics[k])}"
        for k in names[:_MAX_CONSOLE_VAL]
    )
    more = len(names) - _MAX_CONSOLE_VAL
    return shown + (f" | +{more} more in metrics.jsonl" if more > 0 else "")


class ConsoleBackend:
    """A live rich progress bar with metric lines above it on a terminal; plain lines otherwise.

    Plain mode (stdout not a TTY: CI logs, SLURM output files, pipes) prints one self-contained line per
    shown step, with a text bar, elapsed time and ETA, so logs read well with ``tail -f`` and ``grep``.
    """

    _BAR_WIDTH = 20

    def __init__(self, total_steps: Optional[int], every: int, start_step: int, run_name: Optional[str] = None):
        self._run_name = run_name
        self._total = total_steps
        self._every = every
        self._start_step = start_step
        self._start_time = time.monotonic()
        self._stream = sys.stdout
        isatty = getattr(self._stream, "isatty", None)
        self._tty = bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
        self._progress = None
        self._task = None

    def _step_label(self, step: int) -> str:
        return f"step {step}/{self._total}" if self._total else f"step {step}"

    def _eta(self, step: int) -> Optional[float]:
        done = step - self._start_step
        if not self._total or done <= 0:
            return None
        return (time.monotonic() - self._start_time) / done * max(0, self._total - step)

    def _plain_progress(self, step: int) -> str:
        elapsed = _format_duration(time.monotonic() - self._start_time)
        if not self._total:
            return f"[{self._step_label(step)} {elapsed}]"
        fraction = min(1.0, max(0.0, step / self._total))
        filled = int(round(fraction * self._BAR_WIDTH))
        bar = "#" * filled + "." * (self._BAR_WIDTH - filled)
        eta = self._eta(step)
        eta_text = _format_duration(eta) if eta is not None else "?"
        return f"[{self._step_label(step)} {bar} {fraction:4.0%} {elapsed} eta {eta_text}]"

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self._progress = Progress(
            TextColumn("step {task.completed}/{task.total}" if self._total else "step {task.completed}"),
            BarColumn(), TaskProgressColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=Console(file=self._stream), transient=False,
        )
        self._task = self._progress.add_task("train", total=self._total, completed=self._start_step)
        self._progress.start()

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=self._stream, flush=True)

    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None:
        if self._run_name:  # the project / experiment heads the run's lines
            print(f"rlmega run {self._run_name}", file=self._stream, flush=True)
            self._run_name = None
        if self._tty and self._progress is None:
            self._start_live()
        if validation:
            self._print(f"[val @ step {step}] {format_validation_metrics(metrics)}")
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step)
        shown = step % self._every == 0 or step == self._total or step == self._start_step + 1
        if not shown:
            return
        head = self._step_label(step) if self._tty else self._plain_progress(step)
        self._print(f"{head} {format_step_metrics(metrics)}")

    def log_generations(self, step: int, samples: list[dict]) -> None:
        for index, sample in enumerate(samples, 1):
            self._print(f"[val @ step {step}] sample {index}: {_clip(sample['prompt'])!r} -> "
                        f"{_clip(sample['response'])!r} (expected {_clip(sample['ground_truth'])!r}, "
                        f"score {_format_number(sample['score'])})")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _clip(text: str, limit: int = 200) -> str:
    """One console line's worth of ``text``: the end of a long prompt, which is where the question is."""
    text = str(text)
    return text if len(text) <= limit else "..." + text[-limit:]


def _json_value(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


class JsonlBackend:
    """``run_dir/metrics.jsonl``: one strict-JSON object per line, flushed at every row.

    Rows are ``{"step": k, ...}``: one training row per step, plus one row of ``val/...`` keys per
    validation. NaN and infinities are written as ``null``.

    Resume: with ``resume_step=s`` the run continues after a checkpoint taken at the end of step ``s``
    (so the next training row is ``s + 1``). Rows with step <= s are kept, rows with step > s (written
    by the interrupted run after its last checkpoint; they will be recomputed) are dropped, as is a
    torn last line; the file is rewritten atomically and then appended to. With ``resume_step=None``
    the run is new and an existing file is replaced.
    """

    def __init__(self, path: Path, resume_step: Optional[int]):
        self.path = path
        self._resume_step = resume_step
        self.kept_rows, self._file = self._open_rows(path, resume_step)
        self._generations = None  # generations.jsonl beside it, opened by the first samples

    @classmethod
    def _open_rows(cls, path: Path, resume_step: Optional[int]):
        """(rows kept, the file open for appending) under the resume rule above."""
        kept: list[dict] = []
        if resume_step is not None and path.exists():
            kept = cls._rows_up_to(path, resume_step)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in kept)
            os.replace(tmp, path)
            return kept, open(path, "a", encoding="utf-8")
        return kept, open(path, "w", encoding="utf-8")

    @staticmethod
    def _rows_up_to(path: Path, resume_step: int) -> list[dict]:
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    warnings.warn(f"{path}:{line_number}: dropping a line that is not JSON (torn write?)")
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resume_step:
                    rows.append(row)
        return rows

    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None:
        row = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def log_generations(self, step: int, samples: list[dict]) -> None:
        """One row per sample in ``generations.jsonl`` (same resume rule as the metrics)."""
        if self._generations is None:
            self._generations = self._open_rows(self.path.with_name(GENERATIONS_NAME), self._resume_step)[1]
        for sample in samples:
            row = {"step": step, **{key: sample[key] for key in GENERATION_COLUMNS}}
            self._generations.write(json.dumps(row, allow_nan=False, default=str) + "\n")
        self._generations.flush()

    def close(self) -> None:
        self._file.close()
        if self._generations is not None:
            self._generations.close()


class StepRows:
    """A jsonl file of one ``{"step": k, ...}`` row per step, under ``JsonlBackend``'s resume rule."""

    def __init__(self, path: Path, resume_step: Optional[int]):
        self._file = JsonlBackend._open_rows(path, resume_step)[1]

    def write(self, step: int, row: dict) -> None:
        self._file.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    """Scalars under ``run_dir/tensorboard``; on resume, events after the resume step are purged."""

    def __init__(self, log_dir: Path, resume_step: Optional[int], run_config: Optional[Mapping],
                 run_name: Optional[str] = None):
        from torch.utils.tensorboard import SummaryWriter

        purge_step = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if resume_step is None and run_name:
            self._writer.add_text("run", run_name, global_step=0)
        if run_config and resume_step is None:
            text = json.dumps(run_config, indent=2, default=str)
            self._writer.add_text("config", "```\n" + text + "\n```", global_step=0)

    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_generations(self, step: int, samples: list[dict]) -> None:
        self._writer.add_text("val/generations", _markdown_table(samples), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _markdown_table(samples: list[dict]) -> str:
    escape = lambda value: str(value).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| " + " | ".join(GENERATION_COLUMNS) + " |", "|" + " --- |" * len(GENERATION_COLUMNS)]
    lines += ["| " + " | ".join(escape(sample[key]) for key in GENERATION_COLUMNS) + " |" for sample in samples]
    return "\n".join(lines)


def _saved_run_id(path: Path) -> Optional[str]:
    if not path.exists():
        return None
    return path.read_text().strip() or None


class WandbBackend:
    """A W&B run whose id is kept in ``run_dir/wandb_run_id``, so a resumed trainer continues the same run.

    W&B keeps the first value it got for a step; after a resume the steps after ``resume_step`` logged
    by the interrupted run stay in W&B (metrics.jsonl and TensorBoard drop them).
    """

    def __init__(self, run_dir: Path, config: MetricsConfig, run_config: Optional[Mapping]):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = _saved_run_id(id_file) or wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=config.project, name=config.experiment_name, id=run_id, resume="allow",
                               dir=str(run_dir), config=json.loads(json.dumps(dict(run_config or {}), default=str)))

    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None:
        self._run.log(metrics, step=step)

    def log_generations(self, step: int, samples: list[dict]) -> None:
        import wandb

        table = wandb.Table(columns=list(GENERATION_COLUMNS),
                            data=[[sample[key] for key in GENERATION_COLUMNS] for sample in samples])
        self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")
_MLFLOW_PARAM_CHARS = 500  # the smallest value-length limit across MLflow releases


class MlflowBackend:
    """An MLflow run (tracking URI from ``MLFLOW_TRACKING_URI``, else MLflow's default ``./mlruns``).

    The run id is kept in ``run_dir/mlflow_run_id`` and a resumed trainer logs into the same run; the
    run config goes in as flattened params (``a.b.c``) once, when the run is created. Characters MLflow
    refuses in metric names become ``_``.
    """

    def __init__(self, run_dir: Path, config: MetricsConfig, run_config: Optional[Mapping]):
        import mlflow

        self._mlflow = mlflow
        id_file = run_dir / "mlflow_run_id"
        run_id = _saved_run_id(id_file)
        if run_id is None:
            mlflow.set_experiment(config.project)
            run = mlflow.start_run(run_name=config.experiment_name)
            if run_config:
                mlflow.log_params({k: str(v)[:_MLFLOW_PARAM_CHARS] for k, v in _flatten(run_config).items()})
        else:
            run = mlflow.start_run(run_id=run_id)
        id_file.write_text(run.info.run_id + "\n")

    def log(self, step: int, metrics: dict[str, float], validation: bool) -> None:
        self._mlflow.log_metrics({_MLFLOW_BAD_CHARS.sub("_", k): v for k, v in metrics.items()}, step=step)

    def log_generations(self, step: int, samples: list[dict]) -> None:
        columns = {key: [sample[key] for sample in samples] for key in GENERATION_COLUMNS}
        self._mlflow.log_table(data=columns, artifact_file=f"val_generations/step_{step:07d}.json")

    def close(self) -> None:
        self._mlflow.end_run()



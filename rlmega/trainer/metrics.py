"""Metrics of the RL trainer: one tracker that sends each step's numbers to the configured backends.

The trainer is a single controller, so one process owns the tracker; nothing here is collective.

```python
tracker = MetricsTracker(run_dir, MetricsConfig(backends=["console", "jsonl"]), total_steps=100)
with tracker.phase("gen"):                      # -> timing_s/gen in the next tracker.log row
    ...
tracker.log(step, {"actor/pg_loss": 0.1, **batch_metrics(scores, lengths, truncated)})
tracker.log_validation(step, {"val/accuracy": 0.35})
tracker.close()                                 # flush everything, write reward_curve.png
```

Metric names follow verl's: ``actor/...``, ``critic/score/mean``, ``response_length/mean``,
``timing_s/<phase>``, ``perf/...``, ``val/...``. Backends: console, jsonl (``metrics.jsonl``),
tensorboard, wandb, mlflow. The optional ones are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from rlmega.config.schema import MetricsConfig
from rlmega.trainer import plots

from rlmega.trainer.metric_backends import (
    GENERATION_COLUMNS, JSONL_NAME, PLOT_NAME, RESPONSE_LENGTH_KEY, SCORE_KEY, TENSORBOARD_DIR, TIMING_PREFIX, VAL_PREFIX,
    ConsoleBackend, JsonlBackend, MetricsBackend, MlflowBackend, TensorBoardBackend, WandbBackend,
    OPTIONAL_PACKAGES, as_number, require_package,
)

class MetricsTracker:
    """Sends each step's metrics to the configured backends; keeps the history for the reward curve.

    Args:
        run_dir: the run's folder (created if missing); metrics.jsonl, reward_curve.png, tensorboard/ go here.
        config: which backends, names, console cadence, plot.
        total_steps: training steps of the whole run, for the progress bar and ETA (None: unknown).
        run_config: the run's whole config as a plain dict, recorded by tensorboard, wandb and mlflow.
        resume_step: the step of the checkpoint the run resumes from (its rows are kept; later ones are
            dropped, see ``JsonlBackend``); None for a new run.

    An optional backend that is asked for but not installed raises ``ImportError`` naming the pip
    command, before any file is touched.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: Optional[MetricsConfig] = None,
        *,
        total_steps: Optional[int] = None,
        run_config: Optional[Mapping[str, Any]] = None,
        resume_step: Optional[int] = None,
    ):
        self.config = config or MetricsConfig()
        if resume_step is not None and resume_step < 0:
            raise ValueError(f"resume_step must be >= 0 or None, got {resume_step}")
        for name in self.config.backends:
            if name in OPTIONAL_PACKAGES:
                require_package(name)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self._plot = self.config.plot and plots.matplotlib_available()
        if self.config.plot and not self._plot:
            warnings.warn("matplotlib is not installed: no reward_curve.png (pip install matplotlib)")

        self._train_score: list[tuple[int, float]] = []
        self._response_length: list[tuple[int, float]] = []
        self._val: dict[str, list[tuple[int, float]]] = {}
        self._pending_timings: dict[str, float] = {}
        self._closed = False

        self._backends: list[MetricsBackend] = []
        try:
            for name in self.config.backends:
                self._backends.append(self._make_backend(name, resume_step, run_config))
        except BaseException:
            self.close()
            raise

    def _make_backend(self, name: str, resume_step: Optional[int], run_config) -> MetricsBackend:
        if name == "console":
            return ConsoleBackend(self.total_steps, self.config.console_every, resume_step or 0,
                                  run_name=f"{self.config.project}/{self.config.experiment_name}")
        if name == "jsonl":
            backend = JsonlBackend(self.run_dir / JSONL_NAME, resume_step)
            for row in backend.kept_rows:
                self._remember(row["step"], {k: v for k, v in row.items() if k != "step" and v is not None})
            return backend
        if name == "tensorboard":
            return TensorBoardBackend(self.run_dir / TENSORBOARD_DIR, resume_step, run_config,
                                      run_name=f"{self.config.project}/{self.config.experiment_name}")
        if name == "wandb":
            return WandbBackend(self.run_dir, self.config, run_config)
        return MlflowBackend(self.run_dir, self.config, run_config)

    def _remember(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if key.startswith(VAL_PREFIX):
                self._val.setdefault(key, []).append((step, value))
        if SCORE_KEY in metrics:
            self._train_score.append((step, metrics[SCORE_KEY]))
        if RESPONSE_LENGTH_KEY in metrics:
            self._response_length.append((step, metrics[RESPONSE_LENGTH_KEY]))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricsTracker is closed")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record training step ``step``: ``metrics`` plus the ``timing_s/...`` of the phases timed since
        the last call (a value passed in ``metrics`` wins). Values: numbers or 0-dim tensors."""
        self._check_open()
        row = {f"{TIMING_PREFIX}{k}": v for k, v in self._pending_timings.items()}
        row.update({k: as_number(k, v) for k, v in metrics.items()})
        self._pending_timings.clear()
        self._remember(step, row)
        for backend in self._backends:
            backend.log(step, row, validation=False)

    def log_validation(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record a validation after training step ``step`` (0: before training). Keys get a ``val/``
        prefix if they lack one. Also redraws the reward curve."""
        self._check_open()
        row = {(k if k.startswith(VAL_PREFIX) else VAL_PREFIX + k): as_number(k, v) for k, v in metrics.items()}
        self._remember(step, row)
        for backend in self._backends:
            backend.log(step, row, validation=True)
        self.write_plot()

    def log_generations(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """Validation samples after step ``step`` (prompt, response, ground_truth, score each): shown on
        the console, written to ``generations.jsonl``, a text table in TensorBoard / W&B / MLflow."""
        self._check_open()
        missing = [key for key in GENERATION_COLUMNS for sample in samples if key not in sample]
        if missing:
            raise ValueError(f"log_generations: every sample needs {', '.join(GENERATION_COLUMNS)}; missing {missing[0]}")
        rows = [{key: (as_number(key, sample[key]) if key == "score" else str(sample[key])) for key in GENERATION_COLUMNS}
                for sample in samples]
        for backend in self._backends:
            backend.log_generations(step, rows)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block into ``timing_s/<name>`` of the next ``log`` row; repeated names add up.

        Wall time on the controller: GPU work is included when the block waits for it (as ``ray.get`` does).
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self._pending_timings[name] = self._pending_timings.get(name, 0.0) + time.perf_counter() - start

    def write_plot(self) -> Optional[Path]:
        """Write run_dir/reward_curve.png from the history so far; returns its path, or None if skipped."""
        if not self._plot or not (self._train_score or self._val):
            return None
        path = self.run_dir / PLOT_NAME
        plots.plot_reward_curve(path, self._train_score, self._val, self._response_length,
                                title=self.config.experiment_name)
        return path

    def close(self) -> None:
        """Flush and close every backend and write the reward curve. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._backends:
                self.write_plot()
        finally:
            for backend in self._backends:
                backend.close()

    def __enter__(self) -> "MetricsTracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_float64(name: str, values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to(device="cpu", dtype=torch.float64)
    else:  # straight to float64: python floats would pass through float32 otherwise
        tensor = torch.tensor(values, dtype=torch.float64)
    if tensor.numel() == 0:
        raise ValueError(f"batch_metrics: {name} is empty")
    return tensor


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def batch_metrics(
    scores: Sequence[float] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    truncated: Sequence[bool] | torch.Tensor,
    advantages: Optional[Sequence[float] | torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    rewards: Optional[Sequence[float] | torch.Tensor] = None,
    prompt_lengths: Optional[Sequence[int] | torch.Tensor] = None,
) -> dict[str, float]:
    """The data metrics of one batch of ``B`` responses, under verl's names.

    Args:
        scores: ``[B]`` sequence scores from the reward function -> ``critic/score/{mean,max,min}``.
        response_lengths: ``[B]`` response tokens -> ``response_length/{mean,max,min}``.
        truncated: ``[B]`` whether each response was cut by the token limit (the engine's finish reason
            ``length``) -> ``response_length/clip_ratio``, the fraction cut.
        advantages: ``[B]`` per sequence, or ``[B, T]`` per token -> ``critic/advantages/{mean,max,min}``
            over valid tokens: ``response_mask`` ``[B, T]`` if given, else the first ``response_lengths[i]``
            columns of row i.
        rewards: ``[B]`` sequence rewards after any KL penalty -> ``critic/rewards/{mean,max,min}``.
        prompt_lengths: ``[B]`` prompt tokens -> ``prompt_length/{mean,max,min}``.
    """
    score_t = _as_float64("scores", scores)
    length_t = _as_float64("response_lengths", response_lengths)
    if score_t.shape != length_t.shape or score_t.dim() != 1:
        raise ValueError(f"batch_metrics: scores {tuple(score_t.shape)} and response_lengths "
                         f"{tuple(length_t.shape)} must both be [B]")
    out = _stats("critic/score", score_t)
    if rewards is not None:
        out.update(_stats("critic/rewards", _as_float64("rewards", rewards)))
    if advantages is not None:
        adv = _as_float64("advantages", advantages)
        if adv.dim() == 2:
            if response_mask is not None:
                mask = torch.as_tensor(response_mask).to("cpu").bool()
            else:
                mask = torch.arange(adv.shape[1]).unsqueeze(0) < length_t.unsqueeze(1)
            if mask.shape != adv.shape:
                raise ValueError(f"batch_metrics: response_mask {tuple(mask.shape)} must match advantages "
                                 f"{tuple(adv.shape)}")
            adv = adv[mask]
            if adv.numel() == 0:
                raise ValueError("batch_metrics: advantages has no valid token")
        out.update(_stats("critic/advantages", adv))
    out.update(_stats("response_length", length_t))
    truncated_t = _as_float64("truncated", truncated)
    if truncated_t.shape != length_t.shape:
        raise ValueError(f"batch_metrics: truncated {tuple(truncated_t.shape)} must be [B] like response_lengths")
    out["response_length/clip_ratio"] = truncated_t.mean().item()
    if prompt_lengths is not None:
        out.update(_stats("prompt_length", _as_float64("prompt_lengths", prompt_lengths)))
    return out

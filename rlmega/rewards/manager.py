"""The reward manager: a response's score is a weighted sum of the scores of its components.

    manager = RewardManager(RewardConfig(weights={"rule": 1.0, "reward_model": 0.5}),
                            {"rule": RewardScorer(), "reward_model": reward_model_scorer},
                            transforms={"reward_model": ScoreTransform("running", clip_range=(-3.0, 3.0))})
    scores, metrics = manager.score_batch(items)        # list[float]; reward/<name>/mean, .../errors, ...
    scored, metrics = manager.score_each(items)         # ItemScore each: score, the scorers' other numbers, failed

Components (``COMPONENTS``), each anything with ``score_items(items) -> list[Outcome]`` and ``close()``:
``rule`` (the rule scorer of each item's ``data_source``), ``user_function`` (``reward.user_function``),
``reward_model`` (a discriminative reward model, ``rlmega.rewards.reward_model``) and ``judge`` (a
generative judge, ``rlmega.rewards.judge``). Weights come per ``data_source`` (``RewardWeights``); a
component is run only on the items whose weight for it is not 0 (or on all, when monitored). A component
that fails on an item, or fails as a whole, scores 0 for those items and is counted; the batch goes on.
Model scores can be normalised (batch or running z-score) and clipped before they are weighted
(``ScoreTransform``). Calls are serialised by a lock: the synchronous loop and a background rollout
producer may both score, and a reward model's ranks must see their collective calls in one order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Optional, Protocol

from rlmega.rewards.pool import Outcome
from rlmega.rewards.scorer import RewardConfig, ScoreItem

logger = logging.getLogger(__name__)

COMPONENTS = ("rule", "user_function", "reward_model", "judge")
MODEL_COMPONENTS = ("reward_model", "judge")
"""Components whose scores are timed (``timing_s/<name>``) and may be normalised and clipped."""


class Component(Protocol):
    def score_items(self, items: Sequence[ScoreItem]) -> list[Outcome]: ...
    def close(self) -> None: ...


def enabled_components(*, user_function: bool, reward_model: bool, judge: bool) -> tuple[str, ...]:
    """The components a run has: the rule scorers always, the others when configured."""
    present = {"rule": True, "user_function": user_function, "reward_model": reward_model, "judge": judge}
    return tuple(name for name in COMPONENTS if present[name])


class RewardWeights:
    """The weight of every component for a response, by its ``data_source`` (and for validation).

    ``reward.weights`` is the default set (empty: the enabled model components at 1 each, else the user
    function, else the rule scorer); ``reward.data_source_weights[source]`` replaces entries of it for
    that source; ``reward.val_weights`` (when not empty) is the set of validation, for every source."""

    def __init__(self, config: RewardConfig, enabled: Collection[str]):
        self.enabled = tuple(enabled)
        models = {name: 1.0 for name in MODEL_COMPONENTS if name in self.enabled}
        automatic = models or {"user_function" if "user_function" in self.enabled else "rule": 1.0}
        self.default = {name: float(w) for name, w in (config.weights or automatic).items()}
        self.by_source = {source: {**self.default, **{name: float(w) for name, w in overrides.items()}}
                          for source, overrides in config.data_source_weights.items()}
        self.validation = {name: float(w) for name, w in config.val_weights.items()} or None
        self.monitored = tuple(config.monitor)

    def of(self, data_source: str, *, validation: bool = False) -> dict[str, float]:
        """``{component: weight}`` for a response to a prompt of ``data_source``."""
        if validation and self.validation is not None:
            return self.validation
        return self.by_source.get(data_source, self.default)

    def runs(self, component: str, data_source: str, *, validation: bool = False) -> bool:
        """Whether ``component`` scores such a response (a weight that is not 0, or monitored)."""
        return component in self.monitored or self.of(data_source, validation=validation).get(component, 0.0) != 0.0

    def check(self) -> None:
        """ValueError naming the first setting (``reward.weights.<name>``, ...) that names an unknown
        component, weighs a component the run does not have, or is not a finite number."""
        settings = [(f"reward.weights.{name}", name, w) for name, w in self.default.items()]
        settings += [(f"reward.data_source_weights.{source}.{name}", name, w)
                     for source, weights in self.by_source.items() for name, w in weights.items()]
        settings += [(f"reward.val_weights.{name}", name, w) for name, w in (self.validation or {}).items()]
        settings += [(f"reward.monitor[{index}]", name, 1.0) for index, name in enumerate(self.monitored)]
        for field, name, weight in settings:
            if name not in COMPONENTS:
                raise ValueError(f"{field}: {name!r} is not a reward component; valid: {', '.join(COMPONENTS)}")
            if not math.isfinite(weight):
                raise ValueError(f"{field}: the weight must be a finite number, got {weight}")
            if weight != 0.0 and name not in self.enabled:
                raise ValueError(f"{field}: the run has no {name} component ({_ENABLE[name]})")


_ENABLE = {"user_function": "set reward.user_function", "reward_model": "set reward_model.enable=true",
           "judge": "set judge.enable=true"}


class ScoreTransform:
    """Normalisation and clipping of a model component's scores, before they are weighted.

    ``normalize``: ``none``; ``batch`` (z-score over the call's scored items); ``running`` (z-score by the
    mean and variance of every score seen so far in training, this call's included; validation calls use
    them without adding to them). Then ``clip_range`` ``(low, high)`` clamps. Items whose scoring failed
    stay 0. Not thread-safe by itself: the manager calls it under its lock."""

    EPS = 1e-6

    def __init__(self, normalize: str = "none", clip_range: Optional[Sequence[float]] = None):
        if normalize not in ("none", "batch", "running"):
            raise ValueError(f"normalize {normalize!r} is not one of none, batch, running")
        self.normalize = normalize
        self.clip_range = tuple(clip_range) if clip_range is not None else None
        self.count, self.mean, self._m2 = 0, 0.0, 0.0

    @property
    def active(self) -> bool:
        return self.normalize != "none" or self.clip_range is not None

    def __call__(self, scores: list[float], ok: list[bool], *, update: bool = True) -> list[float]:
        values = [score for score, good in zip(scores, ok) if good]
        mean, std = 0.0, 1.0
        if self.normalize == "batch" and values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        elif self.normalize == "running":
            if update:
                for value in values:  # Welford's update
                    self.count += 1
                    delta = value - self.mean
                    self.mean += delta / self.count
                    self._m2 += delta * (value - self.mean)
            mean = self.mean
            std = math.sqrt(self._m2 / self.count) if self.count else 1.0
        out = [(score - mean) / (std + self.EPS) if good else 0.0 for score, good in zip(scores, ok)]
        if self.clip_range is not None:
            low, high = self.clip_range
            out = [min(max(score, low), high) if good else 0.0 for score, good in zip(out, ok)]
        return out


@dataclasses.dataclass
class ItemScore:
    """One item's combined score, the other numbers its scorers gave beside their scores (``{"score": 1, "acc": 1}``
    gives ``acc``; where two components give one name, the first of ``COMPONENTS`` wins), and whether a component
    failed on it (its score counted 0)."""

    score: float
    extras: dict[str, float]
    failed: bool


class RewardManager:
    """Scores batches of items with every component they need and combines the scores by weight.

    ``score_batch`` returns the combined scores and the metrics: ``reward/mean`` (combined),
    ``reward/errors`` and ``reward/timeouts`` (items x components that failed, summed), per component
    ``reward/<name>/mean`` (its scores after any transform, failures as 0, over the items it scored),
    ``reward/<name>/errors`` (and ``/timeouts``, ``/raw_mean`` before a transform), ``timing_s/<name>``
    for the model components, and ``reward/extra/<key>`` (a scorer's extra numbers)."""

    def __init__(self, config: RewardConfig, components: Mapping[str, Component],
                 transforms: Optional[Mapping[str, ScoreTransform]] = None):
        self.components = dict(components)
        self.weights = RewardWeights(config, [name for name in COMPONENTS if name in self.components])
        self.transforms = {name: t for name, t in (transforms or {}).items() if t.active}
        self._lock = threading.Lock()

    def check_data_sources(self, data_sources: Collection[str], *, validation: bool = False) -> None:
        """ValueError (listing the valid names) for a data source that the rule component must score
        and that has no rule scorer."""
        from rlmega.rewards.registry import check_data_sources

        check_data_sources([s for s in data_sources if self.weights.runs("rule", s, validation=validation)])

    def score_batch(self, items: Sequence[ScoreItem], *,
                    validation: bool = False) -> tuple[list[float], dict[str, float]]:
        """Combined scores in item order, and the metrics (see the class)."""
        scored, metrics = self.score_each(items, validation=validation)
        return [item.score for item in scored], metrics

    def score_each(self, items: Sequence[ScoreItem], *,
                   validation: bool = False) -> tuple[list[ItemScore], dict[str, float]]:
        """Each item's ``ItemScore`` in item order, and the metrics (see the class)."""
        with self._lock:
            return self._score(items, validation)

    def _score(self, items: Sequence[ScoreItem], validation: bool) -> tuple[list[ItemScore], dict[str, float]]:
        weights = [self.weights.of(item.data_source, validation=validation) for item in items]
        totals = [0.0] * len(items)
        item_extras: list[dict[str, float]] = [{} for _ in items]
        failed = [False] * len(items)
        metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        extras: dict[str, list[float]] = {}
        for name in COMPONENTS:
            chosen = [i for i, item in enumerate(items)
                      if self.weights.runs(name, item.data_source, validation=validation)]
            if not chosen:
                continue
            if name not in self.components:
                raise RuntimeError(f"the reward weights need the {name} component, which this run did not start")
            started = time.perf_counter()
            outcomes = _run(self.components[name], [items[i] for i in chosen], name)
            if name in MODEL_COMPONENTS:
                metrics[f"timing_s/{name}"] = time.perf_counter() - started
            ok = [outcome.status == "ok" for outcome in outcomes]
            scores = [outcome.score if good else 0.0 for outcome, good in zip(outcomes, ok)]
            if name in self.transforms:
                metrics[f"reward/{name}/raw_mean"] = sum(scores) / len(scores)
                scores = self.transforms[name](scores, ok, update=not validation)
            for index, score in zip(chosen, scores):
                totals[index] += weights[index].get(name, 0.0) * score
            errors = sum(outcome.status == "error" for outcome in outcomes)
            timeouts = sum(outcome.status == "timeout" for outcome in outcomes)
            metrics[f"reward/{name}/mean"] = sum(scores) / len(scores)
            metrics[f"reward/{name}/errors"] = float(errors)
            if timeouts:
                metrics[f"reward/{name}/timeouts"] = float(timeouts)
            metrics["reward/errors"] += errors
            metrics["reward/timeouts"] += timeouts
            for index, outcome in zip(chosen, outcomes):
                failed[index] = failed[index] or outcome.status != "ok"
                for key, value in outcome.extras.items():
                    extras.setdefault(key, []).append(value)
                    item_extras[index].setdefault(key, value)
            _log_failures(name, [items[i] for i in chosen], outcomes)
        metrics["reward/mean"] = sum(totals) / len(totals) if totals else 0.0
        metrics.update({f"reward/extra/{key}": sum(values) / len(values) for key, values in extras.items()})
        return [ItemScore(*scored) for scored in zip(totals, item_extras, failed)], metrics

    def close(self) -> None:
        """Close every component (its worker processes, model ranks or engines); idempotent."""
        for component in self.components.values():
            component.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _run(component: Component, items: list[ScoreItem], name: str) -> list[Outcome]:
    """The component's outcomes; a component that raises, or answers with the wrong number of outcomes,
    fails every item it was given (the batch goes on)."""
    try:
        outcomes = list(component.score_items(items))
    except Exception as error:  # noqa: BLE001 - a failing component is an error for its items, not for the run
        return [Outcome("error", message=f"{name} failed: {type(error).__name__}: {error}") for _ in items]
    if len(outcomes) != len(items):
        return [Outcome("error", message=f"{name} gave {len(outcomes)} outcomes for {len(items)} items")
                for _ in items]
    return outcomes


def _log_failures(name: str, items: list[ScoreItem], outcomes: list[Outcome]) -> None:
    failed = [(index, outcome) for index, outcome in enumerate(outcomes) if outcome.status != "ok"]
    if failed:
        index, outcome = failed[0]
        logger.warning("%d of %d %s scores failed and scored 0; first: item %d (%s) %s: %s", len(failed),
                       len(outcomes), name, index, items[index].data_source, outcome.status, outcome.message)

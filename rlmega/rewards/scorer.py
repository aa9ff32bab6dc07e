"""The reward entry point: ``RewardScorer(config).score_batch(items) -> (scores, metrics)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmega.rewards.pool import Outcome, ScoringPool
from rlmega.rewards.registry import check_data_sources, get_rule_scorer
from rlmega.rewards.user_function import as_score, parse_function_spec

logger = logging.getLogger(__name__)


@dataclass
class RewardConfig:
    """How responses are scored."""

    user_function: str | None = None
    """``path/to/file.py:function`` with verl's signature ``(data_source, solution_str, ground_truth, extra_info)``,
    scoring every item; None: the rule scorer of each item's ``data_source``."""
    num_workers: int = 4
    """Scoring processes for the user function (or for the rule scorers with ``rules_in_workers``)."""
    timeout_s: float = 10.0
    """Longest time one call may take in a worker; a call that overruns scores 0 and its worker is replaced."""
    rules_in_workers: bool = False
    """Run the rule scorers in the worker pool too (with the timeout) instead of in the calling process."""
    weights: dict[str, float] = field(default_factory=dict)
    """The reward manager's weight of each component in a response's score (``rlmega.rewards.manager``):
    any of rule, user_function, reward_model, judge. Empty: the model components that are enabled
    (``reward_model``, ``judge``) at 1 each; without one, ``user_function`` when it is set, else ``rule``."""
    data_source_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per ``data_source``, weights that replace entries of ``weights`` for that source's responses, e.g.
    ``{gsm8k: {rule: 1.0, reward_model: 0.5}}``."""
    val_weights: dict[str, float] = field(default_factory=dict)
    """The weights of validation, for every data source; empty: the training weights. E.g. ``{rule: 1.0}``
    measures accuracy by rule while training scores with a reward model."""
    monitor: list[str] = field(default_factory=list)
    """Components to compute and report (``reward/<name>/mean``) for every response even where their weight
    is 0, e.g. ``[rule]`` to watch the true task while training against a reward model."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"RewardConfig.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"RewardConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.user_function is not None:
            parse_function_spec(self.user_function)


@dataclass
class ScoreItem:
    """One response to score, with what its prompt's row says about the answer."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = None
    messages: list[dict[str, str]] | None = None
    """The prompt's chat messages (what a reward model or a judge renders with its own template)."""
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    """The token ids the policy saw and produced (what a reward model with the policy's tokenizer scores)."""

    @classmethod
    def from_record(cls, record: Any, solution_str: str, response_token_ids: list[int] | None = None) -> ScoreItem:
        """The item for a decoded response to a ``rlmega.data.PromptRecord`` (and its token ids, if given)."""
        return cls(record.data_source, solution_str, record.ground_truth, record.extra_info, record.messages,
                   record.prompt_token_ids, response_token_ids)


class RewardScorer:
    """Scores batches of responses by rule or with a user function; failures score 0 and are counted.

    A rule scorer that raises, or a user function that raises, returns something that is not a score, or runs past
    ``timeout_s``, gives 0.0 for that item; the batch goes on. An unknown ``data_source`` (rule scoring) is a
    configuration error and raises ValueError before anything is scored. Close the scorer (or use it as a context
    manager) to end its worker processes.
    """

    def __init__(self, config: RewardConfig | None = None):
        self.config = config or RewardConfig()
        self._pool: ScoringPool | None = None
        if self.config.user_function is not None or self.config.rules_in_workers:
            user_function = self.config.user_function
            if user_function is not None:
                path, name = parse_function_spec(user_function)
                user_function = f"{path}:{name}"
            self._pool = ScoringPool(user_function, self.config.num_workers, self.config.timeout_s)
            self._pool.start()

    def check_data_sources(self, data_sources: Sequence[str]) -> None:
        """Raise ValueError (listing the valid names) if a data source has no scorer; a user function takes all."""
        if self.config.user_function is None:
            check_data_sources(data_sources)

    def score_items(self, items: Sequence[ScoreItem]) -> list[Outcome]:
        """One ``Outcome`` per item, in order: status (ok / error / timeout), score, numeric extras, message."""
        self.check_data_sources([item.data_source for item in items])
        tasks = [(item.data_source, item.solution_str, item.ground_truth, item.extra_info) for item in items]
        if self._pool is not None:
            return self._pool.run(tasks)
        return [_score_in_process(*task) for task in tasks]

    def score_batch(self, items: Sequence[ScoreItem]) -> tuple[list[float], dict[str, float]]:
        """Scores in item order, and metrics: ``reward/mean``, ``reward/errors`` and ``reward/timeouts`` (counts in
        this batch), and ``reward/extra/<key>`` (the mean of each extra numeric key over the items that gave it)."""
        outcomes = self.score_items(items)
        scores = [outcome.score for outcome in outcomes]
        metrics = {
            "reward/mean": sum(scores) / len(scores) if scores else 0.0,
            "reward/errors": float(sum(outcome.status == "error" for outcome in outcomes)),
            "reward/timeouts": float(sum(outcome.status == "timeout" for outcome in outcomes)),
        }
        extras: dict[str, list[float]] = {}
        for outcome in outcomes:
            for key, value in outcome.extras.items():
                extras.setdefault(key, []).append(value)
        metrics.update({f"reward/extra/{key}": sum(values) / len(values) for key, values in extras.items()})
        failed = [(index, outcome) for index, outcome in enumerate(outcomes) if outcome.status != "ok"]
        if failed:
            index, outcome = failed[0]
            logger.warning("%d of %d rewards failed and scored 0; first: item %d (%s) %s: %s", len(failed),
                           len(outcomes), index, items[index].data_source, outcome.status, outcome.message)
        return scores, metrics

    def close(self) -> None:
        """End the worker processes, if any (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _score_in_process(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> Outcome:
    try:
        score, extras = as_score(get_rule_scorer(data_source)(solution_str, ground_truth, extra_info))
    except Exception as error:
        return Outcome("error", message=f"{type(error).__name__}: {error}")
    return Outcome("ok", score=score, extras=extras)

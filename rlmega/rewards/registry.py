"""Rule scorers by ``data_source``: a plain dict; an unknown name raises an error listing the known ones."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

from rlmega.data.synthetic import ARITHMETIC_DATA_SOURCE
from rlmega.rewards.countdown import countdown_score
from rlmega.rewards.exact import arithmetic_score, exact_match_score
from rlmega.rewards.gsm8k import gsm8k_score
from rlmega.rewards.math import math_score

RuleScorer = Callable[[str, Any, "dict | None"], float]

RULE_SCORERS: dict[str, RuleScorer] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "countdown": countdown_score,
    "exact_match": exact_match_score,
    ARITHMETIC_DATA_SOURCE: arithmetic_score,
}


def get_rule_scorer(data_source: str) -> RuleScorer:
    """The rule scorer for ``data_source``; ValueError listing the valid names if there is none."""
    try:
        return RULE_SCORERS[data_source]
    except KeyError:
        raise ValueError(
            f"no rule scorer for data_source {data_source!r}; valid: {sorted(RULE_SCORERS)} "
            "(or give a user reward function as 'path/to/file.py:function')"
        ) from None


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Raise the error of ``get_rule_scorer`` for the first data source that has no rule scorer."""
    for data_source in sorted(set(data_sources)):
        get_rule_scorer(data_source)

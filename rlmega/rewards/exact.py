"""Exact-match scorers: a general one, and the one for rlmega's synthetic arithmetic task."""

from __future__ import annotations

from typing import Any


def exact_match_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth (or one of a list of
    accepted answers), else 0.0."""
    accepted = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    response = solution_str.strip()
    return 1.0 if any(response == str(answer).strip() for answer in accepted) else 0.0


def arithmetic_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response is exactly the answer's digits (surrounding whitespace aside), else 0.0.

    Nothing else may follow the number, so a model is only rewarded once it has learned to stop.
    """
    return exact_match_score(solution_str, str(ground_truth))

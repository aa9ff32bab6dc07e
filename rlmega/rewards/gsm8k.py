"""GSM8K answers: the number after the last ``####`` of a response, compared with the ground truth as a number.

Numbers are normalised before comparing: ``$`` and thousands commas are removed and the value is compared exactly
(``1,000``, ``1000`` and ``1000.00`` match). ``strict=False`` takes the last number of the response when it has
no ``####`` (for models not prompted with the ``####`` format).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_NUMBER = r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_gsm8k_answer(text: str, strict: bool = True) -> str | None:
    """The answer of a response: the number after the last ``####`` (or, not strict, the last number); or None."""
    answers = _STRICT.findall(text)
    if answers:
        return answers[-1]
    if strict:
        return None
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_gsm8k_number(text: str) -> Decimal | None:
    """A GSM8K number as a Decimal (``$``, spaces, commas and a trailing ``.`` ignored); None if it is not one."""
    cleaned = re.sub(r"[\s$,]", "", str(text)).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def gsm8k_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, strict: bool = True) -> float:
    """1.0 when the response's final answer equals the ground truth as a number, else 0.0.

    A ground truth written as a full GSM8K solution (with ``#### 42``) is compared by its final answer.
    """
    predicted = extract_gsm8k_answer(solution_str, strict=strict)
    if predicted is None:
        return 0.0
    truth = str(ground_truth)
    truth = extract_gsm8k_answer(truth) or truth
    predicted_value, truth_value = parse_gsm8k_number(predicted), parse_gsm8k_number(truth)
    return 1.0 if predicted_value is not None and predicted_value == truth_value else 0.0

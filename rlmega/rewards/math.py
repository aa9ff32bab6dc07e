"""Math answers: the last ``\\boxed{...}`` of a response compared with the ground truth after normalisation.

Normalisation (applied to both sides):

- ``\\left``/``\\right``, ``$``, spacing commands (``\\!``, ``\\,``, ``\\;``, ``\\:``, ``~``), ``\\displaystyle``,
  degree marks (``^\\circ``), ``\\%`` and ``%`` are removed, and then all whitespace;
- ``\\dfrac`` and ``\\tfrac`` become ``\\frac``; ``\\frac{a}{b}`` and ``\\frac ab`` become ``a/b`` when ``a`` and
  ``b`` are plain numbers or letters, and ``\\sqrt2`` becomes ``\\sqrt{2}``;
- a unit in ``\\text{...}``/``\\mbox{...}`` after a value is dropped (``5\\text{ cm}`` is ``5``), and a remaining
  ``\\text{X}`` becomes ``X``;
- a leading short variable assignment is dropped (``x=3`` is ``3``), as is a trailing ``.``;
- thousands separators in a plain number are removed (``1,000`` is ``1000``; ``(1,2)`` is left alone).

Two answers match when their normalised strings are equal, or when both are plain numbers (integers, decimals or
``a/b``) of equal value: ``\\frac{1}{2}``, ``1/2``, ``0.5`` and ``.5`` all match, and so do ``2``, ``2.0`` and ``2.``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_REMOVED = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "^{\\circ}", "^\\circ", "\\%",
            "%", "\\$", "$", "~")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SIMPLE_FRACTION = re.compile(r"\\frac\{(-?[\w.]+)\}\{(-?[\w.]+)\}")
_SHORT_FRACTION = re.compile(r"\\frac(\w)(\w)")
_SHORT_SQRT = re.compile(r"\\sqrt(\w)")
_TRAILING_UNIT = re.compile(r"^(.+?)\\(?:text|mbox)\{[^{}]*\}$")
_TEXT = re.compile(r"\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w?=(.+)$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``; None if absent."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(command for command in _BOX_COMMANDS if text.startswith(command, start))
    rest = text[start + len(command):]
    if rest.startswith(" "):
        return re.split(r"[\s$]", rest.lstrip(), maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for position, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:position]
    return None


def normalize_math_answer(answer: str) -> str:
    """The canonical string form of a math answer (see the module docstring for the rules)."""
    text = str(answer).strip()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _REMOVED:
        text = text.replace(token, "")
    text = re.sub(r"\s+", "", text)
    unit = _TRAILING_UNIT.match(text)
    if unit:
        text = unit.group(1)
    text = _TEXT.sub(r"\1", text)
    text = _SIMPLE_FRACTION.sub(r"\1/\2", text)
    text = _SHORT_FRACTION.sub(r"\1/\2", text)
    text = _SHORT_SQRT.sub(r"\\sqrt{\1}", text)
    assignment = _ASSIGNMENT.match(text)
    if assignment:
        text = assignment.group(1)
    if text.endswith("."):
        text = text[:-1]
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _as_number(text: str) -> Fraction | None:
    parts = text.split("/")
    if len(parts) > 2 or not all(_NUMBER.fullmatch(part) for part in parts):
        return None
    value = Fraction(parts[0])
    if len(parts) == 2:
        denominator = Fraction(parts[1])
        if denominator == 0:
            return None
        value /= denominator
    return value


def math_answers_match(predicted: str, ground_truth: str) -> bool:
    """Whether two answers are the same after normalisation (equal strings, or equal plain numbers)."""
    left, right = normalize_math_answer(predicted), normalize_math_answer(ground_truth)
    if left == right:
        return True
    left_number, right_number = _as_number(left), _as_number(right)
    return left_number is not None and left_number == right_number


def math_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response's last boxed answer matches the ground truth, else 0.0 (also when nothing is boxed).

    A ground truth that itself contains ``\\boxed{...}`` is compared by its boxed content.
    """
    predicted = last_boxed(solution_str)
    if predicted is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if math_answers_match(predicted, truth) else 0.0

"""Countdown: an equation in ``<answer>...</answer>`` that uses each given number exactly once to reach the target.

The ground truth is ``{"target": int, "numbers": [int, ...]}``. The equation (the last ``<answer>`` block) may only
hold integers, ``+ - * /``, parentheses and spaces; an ``=`` and anything after it are ignored (``2*5 = 10``). It is
parsed with Python's ``ast`` and evaluated by our own walk over the tree, with exact fractions (``7/2`` is 3.5, and
division by zero fails), so no code is ever executed. Unary signs and powers are not allowed.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

MAX_EQUATION_CHARS = 256
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[\d+\-*/() ]+")
_OPERATIONS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class InvalidEquation(ValueError):
    """The equation is not an arithmetic expression over integers with + - * / and parentheses."""


def extract_equation(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` block, without any ``=`` part; None if there is none."""
    answers = _ANSWER.findall(text)
    if not answers:
        return None
    return answers[-1].split("=")[0].strip()


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """The exact value of an equation and the integers it uses, in order; InvalidEquation when it is not allowed."""
    if len(equation) > MAX_EQUATION_CHARS or not _ALLOWED_CHARS.fullmatch(equation):
        raise InvalidEquation(f"not an arithmetic expression of integers: {equation!r:.80}")
    try:
        tree = ast.parse(equation, mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        raise InvalidEquation(f"does not parse: {equation!r:.80}") from None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise InvalidEquation(f"division by zero in {equation!r:.80}")
            return _OPERATIONS[type(node.op)](left, right)
        raise InvalidEquation(f"{type(node).__name__} is not allowed in {equation!r:.80}")

    try:
        value = walk(tree.body)
    except RecursionError:
        raise InvalidEquation(f"nested too deeply: {equation!r:.80}") from None
    return value, numbers


def countdown_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                    format_score: float = 0.0) -> float:
    """1.0 when the equation uses exactly the given numbers and equals the target; ``format_score`` when it is a
    valid equation that misses; 0.0 when there is no valid equation."""
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r:.120}")
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate_equation(equation)
    except InvalidEquation:
        return 0.0
    available = Counter(int(number) for number in ground_truth["numbers"])
    if Counter(used) == available and value == Fraction(int(ground_truth["target"])):
        return 1.0
    return format_score

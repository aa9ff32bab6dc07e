"""A parser and a demonstration for small models with a short context (``configs/tiny_cpu_tools.yaml``,
``configs/tiny_cpu_agent.yaml``), where the Hermes format's JSON would not fit: a turn that ends with ``=``
asks the calculator for the value of what precedes it.

    3+5=      -> calculator(expression="3+5"), whose output "8" the next turn can copy
    8         -> an answer
"""

from __future__ import annotations

from rlmega.agent.parsers import ToolCall


def equals_calculator(text: str) -> list[ToolCall]:
    expression = text.strip()
    if len(expression) > 1 and expression.endswith("="):
        return [ToolCall("calculator", {"expression": expression[:-1]})]
    return []


def calculator_demonstration(example: dict) -> list[str]:
    """The turns a good trajectory of the arithmetic task takes (``agent.demonstration`` of
    ``configs/tiny_cpu_tools.yaml``): ask the calculator for the prompt's expression, then answer with its value."""
    return [example["messages"][-1]["content"], str(example["ground_truth"])]

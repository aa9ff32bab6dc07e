"""A synthetic arithmetic task for the CPU quickstart: ``"12+7="`` answered by ``"19"``, in the verl row schema."""

from __future__ import annotations

import os
import random

ARITHMETIC_DATA_SOURCE = "rlmega/arithmetic"
ARITHMETIC_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_arithmetic_rows(num_rows: int, seed: int = 0, max_operand: int = 20, operators: str = "+",
                         split: str = "train") -> list[dict]:
    """``num_rows`` problems ``a<op>b=`` with operands in ``[0, max_operand]``; the answer is the integer's digits.

    Rows follow the dataset schema: the prompt is one user message, ``reward_model.ground_truth`` the answer as a
    string, ``data_source`` is ``ARITHMETIC_DATA_SOURCE`` and ``extra_info`` holds the index, split and operands.
    """
    unknown = sorted(set(operators) - set(ARITHMETIC_OPERATORS))
    if unknown or not operators:
        raise ValueError(f"operators must be drawn from {sorted(ARITHMETIC_OPERATORS)}, got {operators!r}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        operator = rng.choice(operators)
        rows.append({
            "data_source": ARITHMETIC_DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}{operator}{b}="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(ARITHMETIC_OPERATORS[operator](a, b))},
            "extra_info": {"index": index, "split": split, "a": a, "b": b, "operator": operator},
        })
    return rows


def write_arithmetic_dataset(path: str | os.PathLike, num_rows: int, seed: int = 0, max_operand: int = 20,
                             operators: str = "+", split: str = "train") -> str:
    """Write ``make_arithmetic_rows(...)`` to a ``.parquet`` (or ``.jsonl``) file; returns the path."""
    from rlmega.data.files import write_rows

    return write_rows(make_arithmetic_rows(num_rows, seed, max_operand, operators, split), path)

"""What a GPU check measured, for its line in tests/gpu/run_gpu_checks.sh.

A check passes or fails on its tolerance; the numbers it stayed within are what tell a bf16 drift from a
near miss. ``measured(cosine=0.998)`` appends ``cosine=0.998`` to the file the runner names in
``RLMEGA_GPU_MEASURES``, and the runner prints it after the check's PASS / FAIL. Outside the runner the line is
still formatted (so the CPU twins exercise it) but written nowhere.
"""

from __future__ import annotations

import os

ENV = "RLMEGA_GPU_MEASURES"


def _text(value) -> str:
    if hasattr(value, "item"):  # a one-element tensor
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}".replace(",", "_") if abs(value) >= 10_000 else str(value)
    return f"{value:.3g}"


def measured(**values) -> str:
    """``key=value`` pairs, space-separated, numbers to three significant digits; appended as one line to the
    runner's file when there is one. Returns the line."""
    line = " ".join(f"{key}={_text(value)}" for key, value in values.items())
    path = os.environ.get(ENV)
    if path and line:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")
    return line

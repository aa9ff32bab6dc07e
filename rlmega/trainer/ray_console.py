"""What Ray itself prints on the driver's console.

Ray's driver runs a thread that prints every error the cluster publishes, among them a paragraph
per dead worker ("A worker died or was killed while executing a task ..."). rlmega reports a dead
worker itself, on one line naming it and its log (``rlmega.trainer.remote``), so that paragraph only
pushes the useful line off the screen. ``quiet_worker_deaths`` moves such paragraphs to a file.

It replaces ``ray._private.worker.print_to_stdstream``, the function that thread calls (a private
API: checked for the Ray versions below, a no-op elsewhere; tests/trainer/test_worker_logs.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

SUPPORTED_RAY = ((2, 40), (2, 70))
"""Ray versions (from, below) whose driver prints published errors through ``print_to_stdstream``."""
_DEATH = "A worker died or was killed"


def quiet_worker_deaths(log_file: Optional[str | Path]) -> bool:
    """Send Ray's dead-worker paragraphs to ``log_file`` (or nowhere) instead of the console; whether
    it applied (False for a Ray version it is not written for)."""
    import ray
    from ray._private import worker

    version = tuple(int(part) for part in ray.__version__.split(".")[:2])
    if not SUPPORTED_RAY[0] <= version < SUPPORTED_RAY[1] or not hasattr(worker, "print_to_stdstream"):
        return False
    original = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    @functools.wraps(original)
    def print_to_stdstream(data, ignore_prefix: bool = False):
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and lines and all(_DEATH in line for line in lines):
            if log_file:
                try:
                    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
                    with open(log_file, "a") as handle:
                        handle.writelines(line + "\n" for line in lines)
                except OSError:
                    pass
            return
        original(data, ignore_prefix)

    worker.print_to_stdstream = print_to_stdstream
    return True

"""The scoring worker process: ``python -m rlmega.rewards._worker TASK_FD RESULT_FD [path/to/file.py:fn]``.

It reads ``(task_id, data_source, solution_str, ground_truth, extra_info)`` tasks from TASK_FD and writes
``(task_id, "ok", score, extras)`` or ``(task_id, "error", message)`` to RESULT_FD. Without a user function it
scores with the rule scorer of the data source. ``None`` or a closed task pipe ends it.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    tasks = Connection(int(argv[1]), writable=False)
    results = Connection(int(argv[2]), readable=False)
    user_function = None
    if len(argv) > 3:
        try:
            from rlmega.rewards.user_function import load_function

            user_function = load_function(argv[3])
        except BaseException:
            results.send(("failed", traceback.format_exc(limit=-4)))
            return 1
    from rlmega.rewards.registry import get_rule_scorer
    from rlmega.rewards.user_function import as_score

    results.send(("ready",))
    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return 0
        if task is None:
            return 0
        task_id, data_source, solution_str, ground_truth, extra_info = task
        try:
            if user_function is None:
                result = get_rule_scorer(data_source)(solution_str, ground_truth, extra_info)
            else:
                result = user_function(data_source=data_source, solution_str=solution_str,
                                       ground_truth=ground_truth, extra_info=extra_info)
            score, extras = as_score(result)
        except Exception as error:
            results.send((task_id, "error", f"{type(error).__name__}: {error}"))
        else:
            results.send((task_id, "ok", score, extras))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

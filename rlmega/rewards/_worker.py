"""The scoring worker process: ``python -m rlmega.rewards._worker TASK_FD RESULT_FD [path/to/file.py:fn]``.

It reads ``(task_id, data_source, solution_str, ground_truth, extra_info)`` tasks from TASK_FD and writes
``(task_id, "ok", score, extras)`` or ``(task_id, "error", message)`` to RESULT_FD. Without a user function it
scores with the rule scorer of the data source. ``None`` or a closed task pipe ends it; so does the death of
the pool's process (``$RLMEGA_POOL_PARENT``), even in the middle of a call: the worker then kills its process group
(itself and whatever the function started), so a driver killed with SIGKILL leaves no scoring process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

PARENT_ENV = "RLMEGA_POOL_PARENT"
"""The pid of the pool's process, set by the pool in each worker's environment."""
PARENT_POLL_S = 0.5


def die_with_parent() -> None:
    """From now on, kill this worker's process group as soon as it is re-parented (the pool's process is gone).
    Polled from a thread rather than PR_SET_PDEATHSIG, which fires when the *thread* that started the worker
    exits (a pool used from a short-lived thread would lose its workers)."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def one_line(error: BaseException) -> str:
    """What a worker that could not start reports: a ``UserError``'s message (it names the file and line), else
    ``Type: message``, on one line."""
    from rlmega.errors import UserError

    message = " ".join(str(error).split())
    if isinstance(error, UserError):
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def main(argv: list[str]) -> int:
    tasks = Connection(int(argv[1]), writable=False)
    results = Connection(int(argv[2]), readable=False)
    die_with_parent()
    user_function = None
    if len(argv) > 3:
        try:
            from rlmega.rewards.user_function import load_function

            user_function = load_function(argv[3])
        except BaseException as error:  # one line: load_function names the file, the line and the error
            results.send(("failed", one_line(error)))
            return 1
    from rlmega.rewards.registry import get_rule_scorer
    from rlmega.rewards.user_function import as_score

    def score(data_source, solution_str, ground_truth, extra_info) -> tuple:
        if user_function is None:
            result = get_rule_scorer(data_source)(solution_str, ground_truth, extra_info)
        else:
            result = user_function(data_source=data_source, solution_str=solution_str,
                                   ground_truth=ground_truth, extra_info=extra_info)
        return ("ok", *as_score(result))

    return serve(tasks, results, score)


def serve(tasks: Connection, results: Connection, answer) -> int:
    """Say ready, then answer ``(task_id, *payload)`` tasks with ``(task_id, *answer(*payload))`` until the task pipe
    closes or brings None; an exception of ``answer`` is the reply ``(task_id, "error", "<Type>: <message>")``."""
    results.send(("ready",))
    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return 0
        if task is None:
            return 0
        task_id, *payload = task
        try:
            reply = answer(*payload)
        except Exception as error:
            results.send((task_id, "error", f"{type(error).__name__}: {error}"))
        else:
            results.send((task_id, *reply))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

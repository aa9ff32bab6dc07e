"""A pool of scoring processes with a per-call timeout: a call that overruns is killed with its worker.

Threads cannot be stopped, so each worker is a separate Python process (``rlmega.rewards._worker``) in its own
process group; a timed-out call's whole group (including anything the function started) is killed with SIGKILL
and a fresh worker replaces it; a worker that dies is replaced the same way (its call scores 0 as an error). A
worker whose pool's process dies, even by SIGKILL, kills its own process group (``_worker.die_with_parent``).
Workers are started with ``subprocess`` rather than ``multiprocessing`` so they do not re-import the trainer's main
module (and with it torch and Megatron). The timeout of a call runs from the moment it is handed to a worker;
worker start-up is not counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

import rlmega
from rlmega.errors import UserError

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rlmega.__file__)))

Task = tuple[str, str, Any, Any]
"""(data_source, solution_str, ground_truth, extra_info)"""


@dataclass
class Outcome:
    """What one call gave: ``status`` is ``ok``, ``error`` or ``timeout``; the score is 0.0 unless ``ok``."""

    status: str
    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    message: str = ""
    value: Any = None
    """What a worker that returns values rather than scores gave (a tool's output); None for scores."""


class _Worker:
    def __init__(self, module: str, arguments: Sequence[str]):
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        command = [sys.executable, "-m", module, str(task_read), str(result_write), *arguments]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        env["RLMEGA_POOL_PARENT"] = str(os.getpid())  # read by rlmega.rewards._worker.die_with_parent
        try:
            self.process = subprocess.Popen(command, pass_fds=(task_read, result_write), start_new_session=True,
                                            stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            os.close(task_write)
            os.close(result_read)
            raise
        finally:
            os.close(task_read)
            os.close(result_write)
        self.tasks = Connection(task_write, readable=False)
        self.results = Connection(result_read, writable=False)
        self.task_index: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and whatever it started) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.tasks.close()
        self.results.close()

    def stop(self) -> None:
        """Ask the worker to exit, then kill whatever is left of its process group."""
        try:
            self.tasks.send(None)
            self.process.wait(timeout=2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class ScoringPool:
    """``num_workers`` scoring processes; ``run(tasks)`` scores a batch with at most ``timeout_s`` per call.

    With ``user_function`` (``path/to/file.py:fn``) every task goes to that function; without, to the rule scorer
    of its data source. Use as a context manager or call ``close()``; workers are also ended when the pool is
    garbage-collected or the interpreter exits.

    ``worker_module`` runs another worker program over the same pipes (``rlmega.agent._tool_worker``: tool calls,
    answered ``(task_id, "value", value)``), started with ``worker_arguments`` after the two pipe descriptors;
    ``label`` names what it loads in start-up errors.
    """

    def __init__(self, user_function: str | None, num_workers: int, timeout_s: float, start_timeout_s: float = 120.0,
                 *, worker_module: str = "rlmega.rewards._worker", worker_arguments: Sequence[str] = (),
                 label: str = "reward function"):
        if num_workers < 1:
            raise ValueError(f"ScoringPool: num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"ScoringPool: timeout_s must be > 0, got {timeout_s}")
        self.user_function = user_function
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.worker_module = worker_module
        self.worker_arguments = [user_function] if user_function else list(worker_arguments)
        self.label = label
        self._workers: list[_Worker] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def start(self) -> None:
        """Start missing workers and wait until each has loaded the user function; ValueError if one cannot."""
        if self._closed:
            raise RuntimeError("ScoringPool is closed")
        starting = [_Worker(self.worker_module, self.worker_arguments)
                    for _ in range(self.num_workers - len(self._workers))]
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for worker in starting:
                if not worker.results.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"a {self.label} worker did not start within {self.start_timeout_s:.0f} s")
                try:
                    message = worker.results.recv()
                except EOFError:
                    raise RuntimeError(f"a {self.label} worker exited while starting "
                                       f"(exit code {worker.process.wait()})")
                if message[0] != "ready":
                    shown = self.user_function or " ".join(self.worker_arguments)
                    raise UserError(f"{self.label} {shown} failed to load: {message[1]}")
        except BaseException:
            for worker in starting:
                worker.kill()
            raise
        self._workers.extend(starting)

    def run(self, tasks: list[Task]) -> list[Outcome]:
        """Score every task; outcomes in task order. Never raises for a task that fails or overruns."""
        outcomes: list[Outcome | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or self._busy():
            if pending and len(self._workers) < self.num_workers:
                self.start()
            for worker in list(self._workers):
                if pending and worker.task_index is None:
                    self._dispatch(worker, pending, tasks)
            busy = self._busy()
            if not busy:
                continue
            earliest = min(worker.deadline for worker in busy)
            ready = wait([worker.results for worker in busy], timeout=max(0.0, earliest - time.monotonic()))
            for worker in busy:
                index = worker.task_index
                if worker.results in ready or worker.results.poll():
                    outcomes[index] = self._receive(worker)
                elif time.monotonic() >= worker.deadline:
                    outcomes[index] = Outcome("timeout", message=f"exceeded {self.timeout_s:g} s")
                    self._remove(worker)
        return outcomes

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker.task_index is not None]

    def _dispatch(self, worker: _Worker, pending: deque, tasks: list[Task]) -> None:
        index = pending.popleft()
        try:
            worker.tasks.send((index, *tasks[index]))
        except OSError:  # the worker died while idle: retry the task on a fresh one
            pending.appendleft(index)
            self._remove(worker)
            return
        worker.task_index = index
        worker.deadline = time.monotonic() + self.timeout_s

    def _receive(self, worker: _Worker) -> Outcome:
        try:
            message = worker.results.recv()
        except (EOFError, OSError):
            code = worker.process.poll()
            self._remove(worker)
            return Outcome("error", message=f"the {self.label} worker died (exit code {code})")
        worker.task_index = None
        if message[1] == "ok":
            return Outcome("ok", score=message[2], extras=message[3])
        if message[1] == "value":
            return Outcome("ok", value=message[2])
        return Outcome("error", message=message[2])

    def _remove(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def close(self) -> None:
        """End every worker (idempotent); the pool cannot be used afterwards."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

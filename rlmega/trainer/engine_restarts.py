"""``rollout.restart_dead_engines``: a rollout engine that dies is replaced, not fatal, within a budget.

An engine actor that dies in a request (killed, out of memory, crashed) is replaced by ``RolloutGroup.replace``: a
new actor of the same engine on the dead one's resources (its placement-group bundle, the same devices). The
replacement serves the checkpoint's weights until the trainer gives it the weights the other engines serve, through
the normal weight sync, and runs the post-sync check on it (``serve``); only then does it get requests. The requests
the dead engine had in flight are submitted again, with the same seeds, and counted.

The budget: each engine may be restarted ``restart_dead_engines`` times within any ``restart_window_steps``
consecutive steps; one more death in that window stops the run as a death does without restarts, naming the
engine and its restarts. So an engine that keeps dying (a bad GPU, a request that always crashes it) does not
restart forever, while rare faults over a long run are each forgiven.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from rlmega.config.schema import RolloutConfig
from rlmega.trainer.remote import WorkerFailure


class EngineRestarts:
    """The restart budget of a group of engines; what was restarted and resubmitted since the last step's metrics."""

    def __init__(self, rollout: RolloutConfig):
        self.limit = rollout.restart_dead_engines
        self.window_steps = rollout.restart_window_steps
        self.step = 0
        """The trainer's current step: the window's clock (the trainer sets it)."""
        self.serve: Callable[[object], Optional[float]] = _no_trainer
        """Give one replacement engine (its handle) the weights the other engines serve and check them (the post-sync
        check's largest log-prob difference, None without it); set by the trainer, called by the engines' group
        only while the training ranks are idle and hold exactly those weights."""
        self._lock = threading.Lock()
        self._restart_steps: dict[int, list[int]] = {}
        self._restarted = self._resubmitted = 0

    def allow(self, engine: int, failure: WorkerFailure) -> int:
        """Count a restart of ``engine``, which died (``failure``): how many it had within the window, this one
        included. WorkerFailure (``failure``'s message and the restarts) when it already had all it may."""
        with self._lock:
            recent = [step for step in self._restart_steps.get(engine, []) if step > self.step - self.window_steps]
            if len(recent) >= self.limit:
                raise WorkerFailure(
                    f"{failure}; it had been restarted {len(recent)} time(s) within the last {self.window_steps} "
                    f"steps, as many as rollout.restart_dead_engines={self.limit} allows "
                    f"(rollout.restart_window_steps={self.window_steps})") from failure
            self._restart_steps[engine] = recent + [self.step]
            self._restarted += 1
            return len(recent) + 1

    def resubmitted(self, requests: int) -> None:
        """``requests`` responses that were in flight on a dead engine were submitted again."""
        with self._lock:
            self._resubmitted += requests

    def metrics(self) -> dict[str, float]:
        """Restarts and resubmitted requests (one per response) since the last call."""
        with self._lock:
            metrics = {"rollout/engine_restarts": float(self._restarted),
                       "rollout/resubmitted_requests": float(self._resubmitted)}
            self._restarted = self._resubmitted = 0
        return metrics


def _no_trainer(engine) -> Optional[float]:
    raise RuntimeError("a restarted engine needs the trainer's weights, and no trainer is attached to its group")

"""How an engine's calls share its model between the threads of a threaded host (a Ray actor with threads).

A threaded Ray actor calls the engine from several threads, so that ``pause_generation`` reaches a running
``generate``. Everything that runs the model or touches the weights (generate, the update steps, sleep, wake)
takes the engine's lock, one at a time; ``pause_generation``, ``resume_generation``, ``weight_version`` and
``health`` do not, so they answer while a call runs.
"""

from __future__ import annotations

import functools


def runs_model(method):
    """Mark an engine method that runs the model or touches the weights: a threaded host runs all of them on
    one thread (``rlmega.trainer.engine_actor.engine_actor_class``)."""
    method.runs_model = True
    return method


def serialised(method):
    """Run an engine method holding ``self._lock`` (a ``threading.RLock``); marked ``runs_model``."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return runs_model(locked)

"""Waiting on Ray with a deadline, and turning a dead worker into an error that names it."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence


from rlmega.errors import RunFailure


class WorkerFailure(RunFailure):
    """A training rank or rollout engine died, raised, or did not answer in time."""

    def __init__(self, message: str, *, dead: Optional[str] = None, actor_id: Optional[str] = None):
        super().__init__(message)
        self.dead = dead
        """The name of the worker that died while it was called (None: it raised, was late, or an actor it called
        died), so that an engine that died in a request can be replaced."""
        self.actor_id = actor_id
        """The Ray actor id of the worker that died: a restart replaces that actor once."""


_actor_names: dict[str, str] = {}
"""Ray actor id (hex) -> the name of a worker this driver started, for the workers other workers call
(engines: the ranks sync weights into them and probe them), so that a death inside such a call names the dead."""


def name_actors(actor_ids: Sequence[str], names: Sequence[str]) -> None:
    _actor_names.update(zip(actor_ids, names))


def wait_all(refs: Sequence[Any], names: Sequence[str], timeout_s: float, what: str) -> list:
    """``ray.get`` of ``refs`` (one per named worker) within ``timeout_s``; raises WorkerFailure
    naming the first worker that failed or is late, and what it was doing."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    pending = dict(zip(refs, names))
    results = {}
    remaining = list(refs)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1, timeout=timeout_s)
        if not done:
            late = ", ".join(pending[ref] for ref in remaining)
            raise WorkerFailure(f"{what}: no answer from {late} within {timeout_s:.0f} s")
        ref = done[0]
        try:
            results[ref] = ray.get(ref, timeout=timeout_s)
        except (RayTaskError, RayActorError) as error:
            raise failure_of(error, pending[ref], what) from error
        except GetTimeoutError as error:
            raise WorkerFailure(f"{what}: no answer from {pending[ref]} within {timeout_s:.0f} s") from error
    return [results[ref] for ref in refs]


def failure_of(error: BaseException, name: str, what: str) -> WorkerFailure:
    """``error``, raised by a Ray call to the worker ``name`` made for ``what``, as a WorkerFailure naming who failed
    and how: ``name`` died, an actor it called died, or it raised."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):  # first: the worker is alive; if an actor it called died, Ray's error is
        cause = error.cause if getattr(error, "cause", None) is not None else error  # a RayActorError too
        died = cause if isinstance(cause, RayActorError) else getattr(cause, "engine_error", None)
        if isinstance(died, RayActorError):  # directly, or in a weight transfer (TransportError.engine_error)
            dead = _actor_names.get(getattr(died, "actor_id", None) or "", "an actor it called")
            return WorkerFailure(f"{what}: {dead} died ({_why(died)}) while {name} was calling it{_log_hint(dead)}")
        return WorkerFailure(f"{what}: {name} raised {type(cause).__name__}: {cause}")
    if isinstance(error, RayActorError):
        return WorkerFailure(f"{what}: {name} died ({_why(error)}){_log_hint(name)}", dead=name,
                             actor_id=getattr(error, "actor_id", None))
    return WorkerFailure(f"{what}: {name} raised {type(error).__name__}: {error}")


def _why(error: Exception) -> str:
    """Ray's reason for an actor's death in a few words (its message runs to a paragraph)."""
    text = " ".join(str(error).split())
    if "ray.kill" in text:
        return "killed by ray.kill"
    if "node has died" in text or "node died" in text:
        return "its node died"
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    if exit_type and exit_type.group(1) == "SYSTEM_ERROR":
        return "its process ended unexpectedly: killed by a signal, out of memory, or crashed"
    because = re.search(r"(The actor (?:is dead|died) because [^.]*)", text)
    return (because.group(1) if because else text.split(". ")[0])[:200]


def _log_hint(name: str) -> str:
    from rlmega.trainer.worker_logs import log_of

    path = log_of(name)
    return f"; its output is in {path}" if path else ""

"""Waiting on Ray with a deadline, and turning a dead worker into an error that names it."""

from __future__ import annotations

from typing import Any, Sequence


class WorkerFailure(RuntimeError):
    """A training rank or rollout engine died, raised, or did not answer in time."""


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
        except RayActorError as error:
            raise WorkerFailure(f"{what}: {pending[ref]} died ({type(error).__name__}: {str(error).splitlines()[0]})") from error
        except RayTaskError as error:
            cause = error.cause if getattr(error, "cause", None) is not None else error
            raise WorkerFailure(f"{what}: {pending[ref]} raised {type(cause).__name__}: {cause}") from error
        except GetTimeoutError as error:
            raise WorkerFailure(f"{what}: no answer from {pending[ref]} within {timeout_s:.0f} s") from error
    return [results[ref] for ref in refs]

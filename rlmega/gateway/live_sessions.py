"""Harness sessions that run while the trainer trains (``rollout.mode=async``).

The harness of each session runs on its own thread for as long as it likes; every engine call it makes through the
gateway waits here (``LiveSession.call``) until the run's asynchronous driver answers it with whatever weights the
engines hold then (``answer``). The driver is told (``ready``) when a call waits and when the harness has ended,
so it can hand the call to an engine, continue or restart it across a weight update, and take the session's group
once all its sessions ended. A waiting call is never failed by a weight sync: it waits for the engines, for at
most ``gateway.session_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from rlmega.rollout.protocol import Generation, SamplingParams


@dataclasses.dataclass
class EngineCall:
    """One engine call of a session, waiting for its reply."""

    prompt_ids: list[int]
    params: SamplingParams
    """As the harness asked (its ``max_tokens`` bounds the reply; the run samples with its own settings)."""
    reply: Future = dataclasses.field(default_factory=Future)


class LiveSession:
    """One harness session of an asynchronous run: ``call`` while one waits for the engines, ``done`` once the
    harness returned, raised or its call ran out of time; then ``trajectory`` (a ``SessionTrajectory``)."""

    def __init__(self, session_id: str, record, sample: int, ready: Callable[["LiveSession"], None]):
        self.id, self.record, self.sample, self.ready = session_id, record, sample, ready
        self.call: Optional[EngineCall] = None
        self.done = False
        self.trajectory = None
        self.policy_versions: list[int] = []
        """Per token the policy generated, in order: the weight version that generated it."""
        self._lock = threading.Lock()

    def ask(self, prompt_ids: Sequence[int], params: SamplingParams, timeout_s: float) -> Generation:
        """The harness's call (on the gateway's thread): waits for its reply."""
        call = EngineCall(list(prompt_ids), params)
        with self._lock:
            if self.done:
                raise RuntimeError(f"session {self.id} has ended")
            self.call = call
        self.ready(self)
        return call.reply.result(timeout=timeout_s)

    def answer(self, reply: Generation, versions: Sequence[int]) -> None:
        """The reply to the waiting call, ``versions`` the weight version of each of its tokens."""
        with self._lock:
            call, self.call = self.call, None
            if call is None or self.done:
                return  # the harness gave up on it
            self.policy_versions += list(versions)
        call.reply.set_result(reply)

    def end(self, trajectory) -> bool:
        """The harness is over (``trajectory`` is what it made); False if it had ended already."""
        with self._lock:
            if self.done:
                return False
            self.done, self.trajectory = True, trajectory
        self.ready(self)
        return True

    def fail_call(self, error: BaseException) -> None:
        """The run is closing: a waiting call gets ``error`` (so its harness ends)."""
        with self._lock:
            call, self.call = self.call, None
        if call is not None and not call.reply.done():
            call.reply.set_exception(error)

    def token_versions(self, fallback: int) -> list[int]:
        """Per token of the trajectory's response, the weight version that produced it: the policy's tokens their
        own, what came back between replies that of the reply before it; ``fallback`` for a lost session's."""
        trajectory = self.trajectory
        if trajectory.lost or not self.policy_versions:
            return [fallback] * len(trajectory.response_token_ids)
        versions, produced, last = [], iter(self.policy_versions), self.policy_versions[0]
        for kept in trajectory.loss_mask:
            if kept:
                last = next(produced, last)
            versions.append(last)
        return versions

"""What the gateway keeps of each agent session: the exact token ids the engine read and wrote, never re-tokenised.

A session is one trajectory of an agent harness. Each call's prompt either extends the session's context (what the
previous call read plus what it wrote, as the harness sends it back) or starts a new segment. When it extends it,
only the new text (a tool's output, the next user message, the template's glue) is tokenised and appended: the
policy's tokens stay exactly as the engine produced them. A segment is a trajectory the trainer can use as it is:
its first prompt, then the response tokens with a mask over the policy's own (``Segment.response_mask``) and the
engine's log-probs of them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Optional

from rlmega.rollout.protocol import Generation


@dataclasses.dataclass
class Segment:
    """One stretch of a session over which every call extended the one before."""

    prompt_ids: list[int]
    """What the first call of the segment read."""
    response_ids: list[int] = dataclasses.field(default_factory=list)
    """Everything after it: the policy's tokens and, between them, the tokens of what came back (tool outputs,
    user messages, template glue)."""
    response_mask: list[int] = dataclasses.field(default_factory=list)
    """1 on the policy's tokens, 0 on the rest."""
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    """The engine's log-prob of each policy token (0.0 elsewhere)."""
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    """Per call, the engine's weight version."""
    context_text: str = ""
    """The segment's text as the harness sees it: prompt and replies, as sent and returned."""
    messages: Optional[list] = None
    """For chat calls: the conversation after the last call (its messages and the reply)."""

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_turn(self, new_ids: list[int], generation: Generation) -> None:
        """``new_ids`` (what came back since the last reply: masked) and the engine's reply (the policy's)."""
        self.response_ids += new_ids + generation.response_token_ids
        self.response_mask += [0] * len(new_ids) + [1] * len(generation.response_token_ids)
        self.rollout_logprobs += [0.0] * len(new_ids) + list(generation.logprobs)
        self.weight_versions.append(generation.weight_version)


@dataclasses.dataclass
class Session:
    id: str
    segments: list[Segment] = dataclasses.field(default_factory=list)
    reward: Optional[float] = None
    calls: int = 0
    last_call: float = dataclasses.field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "reward": self.reward, "calls": self.calls,
                "segments": [dataclasses.asdict(segment) | {"context_ids": segment.context_ids}
                             for segment in self.segments]}


class SessionStore:
    """Every session of the gateway, by id, behind one lock (the server's handlers run on several threads)."""

    def __init__(self, max_sessions: int = 10_000, *, opened_only: bool = False):
        """``opened_only``: calls only for sessions ``open`` made (a training run's), not any id a client names."""
        self.max_sessions, self.opened_only = max_sessions, opened_only
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.new_segments = 0
        """Calls whose prompt did not extend their session's context (a new segment each)."""

    def open(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions[session_id] = Session(session_id)
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None and self.opened_only:
                raise KeyError(f"no open session {session_id!r}: the run opens one per trajectory")
            if session is None:
                if len(self._sessions) >= self.max_sessions:
                    raise OverflowError(f"the gateway holds {self.max_sessions} sessions; collect finished ones "
                                        "(pop) before starting more")
                session = self._sessions[session_id] = Session(session_id)
            return session

    def find(self, session_id: str) -> Optional[Session]:
        with self._lock:
            return self._sessions.get(session_id)

    def pop(self, session_id: str) -> Optional[Session]:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def count_new_segment(self, session: Session) -> None:
        with self._lock:
            if session.segments:
                self.new_segments += 1

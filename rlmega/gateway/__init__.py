"""An OpenAI-compatible gateway in front of the rollout engines, for agents written against the ``openai`` client.
See README.md in this folder."""

from rlmega.gateway.server import Gateway
from rlmega.gateway.sessions import Segment, Session, SessionStore

__all__ = ["Gateway", "Segment", "Session", "SessionStore"]

"""The ``gateway:`` section of a run: rollouts made by an agent harness through the OpenAI-compatible gateway."""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlmega.agent.config import SCORED_TEXTS


@dataclasses.dataclass
class GatewayConfig:
    enabled: bool = False
    """Produce every response with ``harness`` through the gateway instead of one generation (or the agent loop)."""
    harness: Optional[str] = None
    """The agent harness, a function ``harness(base_url, example) -> reward or None`` as ``module:function`` or
    ``file.py:function``; it talks to the policy with an ``openai`` client at ``base_url`` (one session: one
    trajectory). ``example``: the prompt record's messages, ground truth, data source and extra info."""
    parser: str = "hermes"
    """How the policy's tool calls are read from its reply, to answer with OpenAI ``tool_calls``: ``hermes``
    (``<tool_call>{json}</tool_call>``) or a function ``text -> list of calls`` (as ``agent.parser``)."""
    scored_text: str = "trajectory"
    """What the scorers' ``solution_str`` holds, as ``agent.scored_text``: ``trajectory`` (everything after the
    prompt, what came back between the replies included, decoded) or ``final_answer`` (the last reply's text).
    Either way ``extra_info["agent"]`` holds the final answer and the messages."""
    demonstration: Optional[str] = None
    """For the supervised warm-start (``trainer.sft_steps``), as ``agent.demonstration``: a function ``example ->
    list of assistant turn texts`` (``module:function`` or ``file.py:function``). The harness runs on each prompt
    with an engine that answers with these turns, and the warm-start trains on the replies of the trajectories
    the gateway records. None: the warm-start answers each prompt with its ground truth in one turn."""
    host: str = "127.0.0.1"
    """Where the gateway listens; another address than this machine's loopback needs ``token``."""
    port: int = 0
    """0: a free port, chosen at start."""
    token: Optional[str] = None
    """A bearer token the harness must send (its ``api_key``); needed off 127.0.0.1."""
    max_concurrent_sessions: int = 16
    """Harness calls that run at once (threads); the gateway batches their engine calls."""
    session_timeout_s: float = 300.0
    """Longest one harness call may take; past it the session is counted lost and trains nothing."""

    def __post_init__(self):
        if self.enabled and not self.harness:
            raise ValueError("gateway.harness: a harness is needed when gateway.enabled (module:function or "
                             "file.py:function)")
        if type(self.max_concurrent_sessions) is not int or self.max_concurrent_sessions < 1:
            raise ValueError(f"gateway.max_concurrent_sessions: must be an int >= 1, got {self.max_concurrent_sessions!r}")
        if not self.session_timeout_s > 0:
            raise ValueError(f"gateway.session_timeout_s: must be > 0, got {self.session_timeout_s!r}")
        if self.scored_text not in SCORED_TEXTS:
            raise ValueError(f"gateway.scored_text: {self.scored_text!r} is not one of {', '.join(SCORED_TEXTS)}")
        if not self.enabled:
            return
        from rlmega.agent.functions import check_function_spec
        from rlmega.agent.parsers import BUILTIN as BUILTIN_PARSERS
        from rlmega.gateway.server import Gateway

        check_function_spec(self.harness, "gateway.harness")
        if self.parser not in BUILTIN_PARSERS:
            check_function_spec(self.parser, "gateway.parser", f"a built-in parser ({', '.join(BUILTIN_PARSERS)}) or")
        if self.demonstration is not None:
            check_function_spec(self.demonstration, "gateway.demonstration", "")
        Gateway.check_binding(self.host, self.token)

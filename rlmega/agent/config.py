"""The ``agent:`` section of a run: multi-turn rollouts with tool calls and environments."""

from __future__ import annotations

import dataclasses
from typing import Optional

SCORED_TEXTS = ("trajectory", "final_answer")


@dataclasses.dataclass
class AgentConfig:
    enabled: bool = False
    """Produce every response with the agent loop (turns, tool calls, environment) instead of one generation."""
    max_turns: int = 4
    """Policy turns per trajectory; the trajectory ends after this many, even if the last one calls a tool."""
    max_tool_calls: int = 8
    """Tool calls per trajectory; a turn whose calls would pass it ends the trajectory without running them."""
    max_response_tokens: int = 1024
    """Tokens after the prompt: policy turns, tool outputs and chat-template glue together. A turn that
    reaches it is cut there; tool output that would pass it ends the trajectory instead of being appended."""
    tools: list[str] = dataclasses.field(default_factory=list)
    """Tools offered to the model: built-in names (``calculator``, ``python``) or Python functions as
    ``module:function`` or ``path/to/file.py:function`` (rlmega/agent/README.md)."""
    parser: str = "hermes"
    """How a turn's tool calls are read: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    Qwen's and Hermes' format) or a function ``text -> list of calls`` as ``module:function`` or
    ``file.py:function``."""
    environment: Optional[str] = None
    """An environment class (or factory) as ``module:Name`` or ``file.py:Name``, built once per trajectory:
    ``reset(example)`` gives the first messages, ``step(messages)`` answers a turn without tool calls with
    ``(observation, reward, done)``. None: a turn without tool calls ends the trajectory."""
    demonstration: Optional[str] = None
    """For the supervised warm-start (``trainer.sft_steps``): a function ``example -> list of assistant turn texts``
    as ``module:function`` or ``file.py:function``, the turns a good trajectory takes for a prompt (tool calls
    included); the tools run on them as in a rollout and only the turns are trained on. ``example`` is what an
    environment's ``reset`` receives. None: the warm-start answers each prompt with its ground truth in one turn."""
    tool_timeout_s: float = 10.0
    """Longest a tool call may run; it is then killed and the model is told so."""
    tool_memory_mb: int = 1024
    """Address-space limit of each tool worker process (and what it starts, such as the python tool's interpreter)."""
    num_tool_workers: int = 2
    """Tool worker processes; a turn's calls over all trajectories run on them in parallel."""
    max_tool_output_chars: int = 4096
    """A tool's output is cut to this many characters (and "..." added) before it is tokenised."""
    scored_text: str = "trajectory"
    """What the scorers' ``solution_str`` holds: ``trajectory`` (everything after the prompt, tool outputs included,
    decoded) or ``final_answer`` (the last policy turn's text). Either way ``extra_info["agent"]`` holds the
    final answer, the messages and the counts."""

    def __post_init__(self):
        for field in ("max_turns", "max_tool_calls", "max_response_tokens", "tool_memory_mb", "num_tool_workers",
                      "max_tool_output_chars"):
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise ValueError(f"agent.{field}: must be an int >= 1, got {value!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"agent.tool_timeout_s: must be > 0, got {self.tool_timeout_s!r}")
        if self.scored_text not in SCORED_TEXTS:
            raise ValueError(f"agent.scored_text: {self.scored_text!r} is not one of {', '.join(SCORED_TEXTS)}")
        self.tools = list(self.tools)
        if not self.enabled:
            return
        from rlmega.agent.builtin import BUILTIN_TOOLS
        from rlmega.agent.functions import check_function_spec
        from rlmega.agent.parsers import BUILTIN as BUILTIN_PARSERS

        for position, spec in enumerate(self.tools):
            if spec not in BUILTIN_TOOLS:
                check_function_spec(spec, f"agent.tools[{position}]",
                                    f"a built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) or")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"agent.tools: {self.tools} names a tool twice")
        if self.parser not in BUILTIN_PARSERS:
            check_function_spec(self.parser, "agent.parser", f"a built-in parser ({', '.join(BUILTIN_PARSERS)}) or")
        for field in ("environment", "demonstration"):
            if getattr(self, field) is not None:
                check_function_spec(getattr(self, field), f"agent.{field}", "")

"""Multi-turn agentic rollouts: a policy turn, its tool calls run in workers, their outputs appended as tokens,
again, until the model answers, a budget is spent or an environment ends the episode (see README.md).

Importing this package imports neither torch nor transformers; ``rlmega.agent.loop`` needs torch.
"""

from rlmega.agent.config import AgentConfig
from rlmega.agent.parsers import ToolCall, hermes_parser
from rlmega.agent.tools import ToolBox, ToolError, ToolResult, tool

__all__ = ["AgentConfig", "ToolBox", "ToolCall", "ToolError", "ToolResult", "hermes_parser", "tool"]

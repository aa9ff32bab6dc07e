"""Reading a policy turn's tool calls.

A parser takes the turn's text (special tokens kept) and returns its calls. The built-in ``hermes`` parser reads
the format of Hermes and Qwen chat templates::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3*7"}}
    </tool_call>

A user parser (``agent.parser: file.py:function``) returns a list of ``ToolCall`` or of dicts
``{"name": ..., "arguments": {...}}``. A call that cannot be read becomes a ``ToolCall`` with an ``error``: it is
not run, and the error is the tool output the model sees.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Optional

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"

Parser = Callable[[str], list]


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None
    """Why the call could not be read (it is then not run); None for a well-formed call."""
    context: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The row's ``extra_info.tools_kwargs`` entry for this tool (set by the loop, not by parsers): what a tool
    that declares a ``context`` parameter receives there."""


def hermes_parser(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order; an unclosed last block is an error."""
    calls = [_from_json(block) for block in _HERMES_CALL.findall(text)]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if _HERMES_OPEN in tail:
        calls.append(ToolCall("", error="a <tool_call> block is not closed with </tool_call>"))
    return calls


def _from_json(block: str) -> ToolCall:
    try:
        value = json.loads(block)
    except json.JSONDecodeError as error:
        return ToolCall("", error=f"the tool call is not valid JSON ({error.msg} at column {error.colno})")
    return as_tool_call(value)


def as_tool_call(value: Any) -> ToolCall:
    """A parser's item as a ``ToolCall``: a ``ToolCall``, or a dict with ``name`` and optional ``arguments``
    (a dict, or a JSON string of one, as OpenAI's format has it)."""
    if isinstance(value, ToolCall):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall("", error='a tool call must be a JSON object with a "name" and "arguments"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(value["name"], error="the arguments are not valid JSON")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error='"arguments" must be a JSON object')
    return ToolCall(value["name"], arguments)


BUILTIN = {"hermes": hermes_parser}


def load_parser(spec: str) -> Parser:
    """The parser ``agent.parser`` names: a built-in name or a function path."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    from rlmega.agent.functions import load_callable

    return load_callable(spec)


def parse_turn(parser: Parser, text: str) -> tuple[list[ToolCall], Optional[str]]:
    """The turn's calls and, when the parser itself failed (raised, or returned something else than a list),
    its error; the turn then counts as one without calls."""
    try:
        calls = parser(text)
    except Exception as error:  # a user parser's bug must not stop the run
        return [], f"{type(error).__name__}: {error}"
    if not isinstance(calls, (list, tuple)):
        return [], f"the parser returned {type(calls).__name__}, not a list of tool calls"
    return [as_tool_call(call) for call in calls], None

"""Tools: a JSON-schema description plus a Python function, run in worker processes with a timeout and a memory
limit (``rlmega.rewards.pool``, the reward functions' pool, with ``rlmega.agent._tool_worker`` as its program).

A tool is a plain function. Its description is the ``tool_schema`` the ``@tool`` decorator attaches, or, without
it, one read from the signature (annotations ``str``, ``int``, ``float``, ``bool``, ``list``, ``dict``; parameters
without a default are required) and the docstring's first paragraph. It returns a string (anything else is
shown as JSON, or ``str`` of it) or raises: ``ToolError("...")`` tells the model what went wrong in its own
words; any other exception is shown as ``TypeName: message``. Either way the run goes on.

A tool that declares a parameter named ``context`` receives there the dataset row's ``extra_info.tools_kwargs``
entry for the tool (verl's schema, e.g. ``{"create_kwargs": {"ground_truth": "72"}}``; ``{}`` when the row has
none), whatever the model's arguments say; ``context`` is not part of the schema the model sees.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import threading
from typing import Any, Callable, Optional, Sequence

from rlmega.agent.parsers import ToolCall

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_JSON_NAMES = {python_type.__name__: json_type for python_type, json_type in _JSON_TYPES.items()}


CONTEXT = "context"
"""The parameter through which a tool receives its row's ``tools_kwargs`` entry (never the model's)."""


def takes_context(function: Callable) -> bool:
    """Whether the tool declares the ``context`` parameter."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return CONTEXT in parameters


class ToolError(Exception):
    """Raised by a tool to answer the model with an error message (shown as it is)."""


def tool(*, description: str, parameters: dict[str, dict], required: Optional[Sequence[str]] = None,
         name: Optional[str] = None) -> Callable:
    """Attach an OpenAI-style function schema to a tool function: ``parameters`` maps each argument to its JSON
    schema; ``required`` defaults to every parameter; ``name`` to the function's name."""

    def attach(function: Callable) -> Callable:
        function.tool_schema = {"type": "function", "function": {
            "name": name or function.__name__, "description": description,
            "parameters": {"type": "object", "properties": parameters,
                           "required": list(parameters if required is None else required)}}}
        return function

    return attach


def schema_of(function: Callable) -> dict:
    """The tool's schema: its ``tool_schema``, else one from its signature and docstring."""
    schema = getattr(function, "tool_schema", None)
    if schema is not None:
        return schema
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name == CONTEXT:
            continue
        annotation = parameter.annotation
        json_type = _JSON_TYPES.get(annotation) or _JSON_NAMES.get(str(annotation))
        properties[parameter.name] = {"type": json_type} if json_type else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(function) or function.__name__).split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": function.__name__, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def as_output(value: Any) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


@dataclasses.dataclass
class ToolResult:
    output: str
    """What the model reads as the tool's answer (an error's message when the call failed)."""
    status: str = "ok"
    """ok, error (the tool raised, the call was malformed or named no tool) or timeout."""


class ToolBox:
    """The run's tools, in ``num_workers`` worker processes: ``schemas`` for the chat template, ``run`` for calls.

    ``specs`` are built-in tool names or function paths (``agent.tools``). User code is imported only in the
    workers, never in the calling process. Close it (or use it as a context manager) to end the workers.
    """

    def __init__(self, specs: Sequence[str], *, num_workers: int, timeout_s: float, memory_mb: int,
                 max_output_chars: int):
        from rlmega.rewards.pool import ScoringPool

        self.specs = list(specs)
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        arguments = json.dumps({"tools": self.specs, "memory_mb": memory_mb})
        self._pool = ScoringPool(None, num_workers, timeout_s, worker_module="rlmega.agent._tool_worker",
                                 worker_arguments=[arguments], label="tool")
        self.schemas: list[dict] = []
        """Every tool's schema, in ``specs`` order (what the chat template's ``tools=`` receives)."""
        if self.specs:
            outcome = self._pool.run([("describe",)])[0]
            if outcome.status != "ok":
                self.close()
                raise ValueError(f"agent.tools: the tools could not be described: {outcome.message}")
            self.schemas = outcome.value
        self.names = [schema["function"]["name"] for schema in self.schemas]

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Every call's result, in order; calls run in parallel over the workers. Never raises for a call."""
        with self._lock:  # the asynchronous rollout's producer and a validation may call at once
            return self._run(calls)

    def _run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        results: list[Optional[ToolResult]] = [None] * len(calls)
        tasks, positions = [], []
        for position, call in enumerate(calls):
            if call.error is not None:
                results[position] = ToolResult(f"Error: {call.error}", "error")
            elif call.name not in self.names:
                available = ", ".join(self.names) or "none"
                results[position] = ToolResult(f"Error: there is no tool named {call.name!r} (tools: {available})",
                                               "error")
            else:
                tasks.append(("call", call.name, call.arguments, call.context))
                positions.append(position)
        for position, outcome in zip(positions, self._pool.run(tasks) if tasks else []):
            if outcome.status == "ok":
                results[position] = ToolResult(self._cut(outcome.value))
            elif outcome.status == "timeout":
                results[position] = ToolResult(f"Error: the tool call timed out after {self.timeout_s:g} s", "timeout")
            else:
                results[position] = ToolResult(self._cut(f"Error: {outcome.message}"), "error")
        return results

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[:self.max_output_chars] + "..."

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

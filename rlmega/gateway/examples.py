"""Harnesses for the quickstarts' tasks, written as any ``openai`` client would be: what ``gateway.harness`` names."""

from __future__ import annotations

import functools
import json
from typing import Optional

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Add numbers: the value of an expression such as 37+48.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@functools.cache
def _openai():
    """One client for every session, each with its own ``base_url`` (``with_options``): they share its connection
    pool, where a client per session would build its own (tens of milliseconds each)."""
    import openai

    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)


def single_turn(base_url: str, example: dict) -> Optional[float]:
    """Ask the policy the prompt's question in one chat call; the run's reward function scores the answer."""
    client = _openai().with_options(base_url=base_url)
    client.chat.completions.create(model="policy", messages=example["messages"])
    return None


def calculator(base_url: str, example: dict) -> Optional[float]:
    """The tool-use quickstart (``configs/tiny_cpu_tools_gateway.yaml``): the policy may call the calculator once,
    this script adds the numbers, and the policy answers after reading the result; the run's reward function
    scores the last answer (``gateway.scored_text: final_answer``)."""
    client = _openai().with_options(base_url=base_url)
    messages = list(example["messages"])
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]).choices[0]
    if not reply.message.tool_calls:
        return None  # answered without the calculator
    call = reply.message.tool_calls[0]
    try:
        result = str(sum(int(term) for term in json.loads(call.function.arguments)["expression"].split("+")))
    except ValueError:
        result = "Error"  # short: the tiny model reads 64 positions
    messages += [reply.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    return None

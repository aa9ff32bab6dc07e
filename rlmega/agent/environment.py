"""Environments: interactive tasks that answer the policy's turns (``agent.environment``).

An environment is a class (or any factory) built once per trajectory, with no arguments::

    class GuessTheNumber:
        def reset(self, example: dict):
            # example: messages, data_source, ground_truth, extra_info, index (the dataset row)
            self.target = int(example["ground_truth"])
            return None                      # None: the dataset's prompt; else a str (one user message),
                                             # a message dict, or a list of them: the conversation's start
        def step(self, messages: list[dict]):
            # messages: the whole conversation so far, the policy's last turn (role "assistant") last
            guess = messages[-1]["content"].strip()
            if guess == str(self.target):
                return None, 1.0, True       # (observation, reward, done)
            return "higher" if int(guess) < self.target else "lower", 0.0, False

The loop calls ``step`` after every policy turn that calls no tool. The observation (a str is a user message, a
dict a message of its own role) is appended as the next message; ``done`` ends the trajectory. The rewards of a
trajectory's steps are summed and added to its score. An environment that raises ends its trajectory (counted in
``agent/env_errors``); the run goes on.
"""

from __future__ import annotations

from typing import Any, Protocol, Union

Message = dict[str, Any]
Observation = Union[None, str, Message]


class Environment(Protocol):
    def reset(self, example: dict[str, Any]) -> Union[None, str, Message, list[Message]]: ...
    def step(self, messages: list[Message]) -> tuple[Observation, float, bool]: ...


def as_messages(value: Union[None, str, Message, list[Message]], role: str = "user") -> list[Message]:
    """An environment's answer as chat messages: None is none, a str is one ``role`` message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [dict(value)]
    if isinstance(value, (list, tuple)) and all(isinstance(message, dict) for message in value):
        return [dict(message) for message in value]
    raise TypeError(f"expected None, a str, a message dict or a list of them, got {type(value).__name__}")

"""The multi-turn agent loop: many trajectories at once, one batched generation per turn.

Each trajectory starts from its prompt (rendered with the tools). Every turn, all live trajectories generate
together (``Generator.generate``, one response each); each turn's text is parsed for tool calls; every call of
every trajectory runs in the tool workers together; each trajectory then gets its tools' outputs (or its
environment's observation) appended as tokens, and the next turn generates from there. A trajectory ends when
the model answers without a tool call (and no environment, or the environment says done), at ``max_turns``,
``max_tool_calls`` or ``max_response_tokens``.

Token in, token out: a trajectory's ids are the engine's own output tokens and, between them, tool outputs and
template glue tokenised once (``ChatTokens``). ``loss_mask`` is 1 on the policy's tokens and 0 on the others,
whose ``logprobs`` are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from rlmega.agent.config import AgentConfig
from rlmega.agent.environment import Environment, as_messages
from rlmega.agent.parsers import ToolCall, load_parser, parse_turn
from rlmega.agent.template import ChatTokens
from rlmega.agent.tools import ToolBox, ToolResult
from rlmega.rollout.protocol import Generation, SamplingParams

STOP_REASONS = ("answered", "env_done", "max_turns", "max_tool_calls", "max_response_tokens", "turn_length",
                "env_error")


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


class Tools(Protocol):
    """What the loop needs of the tools (``ToolBox`` or a fake)."""

    schemas: list[dict]

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]: ...
    def close(self) -> None: ...


@dataclasses.dataclass
class Trajectory(Generation):
    """A multi-turn response: ``response_token_ids`` is everything after the prompt (policy turns, tool outputs,
    glue), ``logprobs`` the engine's log-prob of each policy token and 0 elsewhere, ``finish_reason`` "length"
    when a token budget cut it and "stop" otherwise."""

    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    """The prompt as rendered with the tools (what the engine's first turn started from)."""
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """``[R]`` 1 on tokens the policy generated, 0 on tool outputs and template glue."""
    messages: list[dict] = dataclasses.field(default_factory=list)
    """The conversation as chat messages (for logs; the tokens are the truth)."""
    num_turns: int = 0
    num_tool_calls: int = 0
    tool_calls_by_name: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls per tool of the run (every tool listed, 0 when not called)."""
    num_invalid_tool_calls: int = 0
    """Calls that could not be read or name no tool of the run (also counted in ``num_tool_errors``)."""
    num_tool_errors: int = 0
    num_tool_timeouts: int = 0
    num_parser_failures: int = 0
    num_env_errors: int = 0
    env_reward: float = 0.0
    turn_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """The environment's reward of each step, with the response position of the last policy token of the turn it
    answered: ``(position, reward)``; their sum is ``env_reward`` unless a step came before any policy token."""
    stop_reason: str = ""
    """Why it ended: one of ``STOP_REASONS``."""


@dataclasses.dataclass
class AgentState:
    """A trajectory being built, with its environment and its row's tool arguments."""

    trajectory: Trajectory
    environment: Optional[Environment]
    tools_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The row's ``extra_info.tools_kwargs``: tool name -> what that tool's ``context`` receives."""
    done: bool = False

    def finish(self, reason: str, *, cut: bool = False) -> None:
        self.done, self.trajectory.stop_reason = True, reason
        self.trajectory.finish_reason = "length" if cut else "stop"

    def extend(self, tokens: Sequence[int], logprobs: Optional[Sequence[float]]) -> None:
        trajectory = self.trajectory
        trajectory.response_token_ids.extend(tokens)
        trajectory.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        trajectory.loss_mask.extend([1 if logprobs is not None else 0] * len(tokens))


def example_of(record) -> dict[str, Any]:
    """What an environment's ``reset`` and a demonstration receive for a prompt record."""
    extra_info = record.extra_info or {}
    return {"messages": [dict(m) for m in record.messages], "data_source": record.data_source,
            "ground_truth": record.ground_truth, "extra_info": extra_info, "index": record.index,
            "interaction_kwargs": dict(extra_info.get("interaction_kwargs") or {})}


def _last_policy_token(loss_mask: Sequence[int]) -> Optional[int]:
    return next((position for position in range(len(loss_mask) - 1, -1, -1) if loss_mask[position]), None)


def turn_reward_tokens(trajectory: Trajectory) -> list[float]:
    """``[R]`` the environment's per-turn rewards at their turns' last policy tokens, 0 elsewhere."""
    rewards = [0.0] * len(trajectory.response_token_ids)
    for position, reward in trajectory.turn_rewards:
        rewards[position] += reward
    return rewards


def _turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    return None if seed is None else (seed + 1_000_003 * turn) % (2**31)


class AgentLoop:
    """Runs trajectories for prompt records (``rlmega.data.PromptRecord``) with the run's tools, parser and
    environment. Build it once per run; ``close`` ends the tool workers."""

    def __init__(self, config: AgentConfig, tokenizer: Any, *, stop_token_ids: Sequence[int],
                 chat_template_kwargs: Optional[dict] = None, tools: Optional[Tools] = None,
                 environment_factory: Optional[Callable[[], Environment]] = None):
        """``tools`` and ``environment_factory`` default to those ``config`` names (tests pass fakes)."""
        self.config = config
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.tools = tools if tools is not None else ToolBox(
            config.tools, num_workers=config.num_tool_workers, timeout_s=config.tool_timeout_s,
            memory_mb=config.tool_memory_mb, max_output_chars=config.max_tool_output_chars)
        self.parser = load_parser(config.parser)
        if environment_factory is None and config.environment is not None:
            from rlmega.agent.functions import load_callable

            environment_factory = load_callable(config.environment)
        self.environment_factory = environment_factory
        self.chat = ChatTokens(tokenizer, tools=self.tools.schemas, stop_token_ids=self.stop_token_ids,
                               chat_template_kwargs=chat_template_kwargs)
        self.tool_names = [schema["function"]["name"] for schema in self.tools.schemas]

    def run(self, generator: Generator, records: Sequence, params: SamplingParams) -> list[Trajectory]:
        """``params.n`` trajectories per record, prompt-major (as ``generate`` orders responses)."""
        lives = [self.start(index, record) for index, record in enumerate(records) for _ in range(params.n)]
        for turn in range(self.config.max_turns):
            live = [state for state in lives if not state.done]
            if not live:
                break
            turn_params = dataclasses.replace(params, n=1, seed=_turn_seed(params.seed, turn))
            generations = generator.generate([self.context(state) for state in live], turn_params)
            self.advance(list(zip(live, sorted(generations, key=lambda g: g.prompt_index))))
        return self.finish(lives)

    def demonstrate(self, records: Sequence, turns: Sequence[Sequence[str]]) -> list[Trajectory]:
        """One trajectory per record whose policy turns are the given texts instead of generations (a supervised
        warm-start's demonstrations): each text is tokenised and ended with the stop token, and everything else
        (tool calls run by the tools, their outputs, glue, the mask) is made as in a rollout."""
        lives = [self.start(index, record) for index, record in enumerate(records)]
        for turn in range(self.config.max_turns):
            live = [(state, texts[turn]) for state, texts in zip(lives, turns) if not state.done and turn < len(texts)]
            if not live:
                break
            self.advance([(state, self._scripted(text)) for state, text in live])
        return self.finish(lives)  # a demonstration that ends early is trained on as far as it goes

    def _scripted(self, text: str) -> Generation:
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.stop_token_ids[0]]
        return Generation(prompt_index=0, response_token_ids=tokens, logprobs=[0.0] * len(tokens),
                          finish_reason="stop", weight_version=0)

    # ---- one trajectory at a time (the asynchronous rollout drives these) ------------------

    def start(self, index: int, record) -> AgentState:
        """A new trajectory for ``record`` (its environment reset, its prompt rendered with the tools)."""
        environment = self.environment_factory() if self.environment_factory is not None else None
        trajectory = Trajectory(prompt_index=index, response_token_ids=[], logprobs=[], finish_reason="stop",
                                weight_version=-1, tool_calls_by_name=dict.fromkeys(self.tool_names, 0))
        messages = [dict(message) for message in record.messages]
        extra_info = record.extra_info or {}
        if environment is not None:
            try:
                messages = as_messages(environment.reset(example_of(record))) or messages
            except Exception:  # a broken environment must not stop the run: counted, the dataset prompt is used
                trajectory.num_env_errors += 1
        trajectory.messages = messages
        trajectory.prompt_token_ids = self.chat.prompt_ids(messages)
        return AgentState(trajectory, environment, dict(extra_info.get("tools_kwargs") or {}))

    @staticmethod
    def context(state: AgentState) -> list[int]:
        """What the trajectory's next turn generates from."""
        return state.trajectory.prompt_token_ids + state.trajectory.response_token_ids

    def advance(self, turns: Sequence[tuple[AgentState, Generation]]) -> None:
        """One policy turn of each trajectory: append it, run all their tool calls together, then append the
        tools' outputs or the environment's observation. A trajectory that ends is marked ``done``."""
        calling: list[tuple[AgentState, list[ToolCall]]] = []
        for state, generation in turns:
            calls = self._take_turn(state, generation)
            if calls:
                calling.append((state, calls))
        self._run_tools(calling)
        called = {id(state) for state, _ in calling}
        for state, _ in turns:
            if not state.done and id(state) not in called:
                self._step_environment(state)

    @staticmethod
    def finish(states: Sequence[AgentState]) -> list[Trajectory]:
        """The trajectories, those still running ended at ``max_turns``."""
        for state in states:
            if not state.done:
                state.finish("max_turns")
        return [state.trajectory for state in states]

    def _take_turn(self, state: AgentState, generation: Generation) -> list[ToolCall]:
        """Append the policy's turn; its tool calls if they are to run (else the state may be finished)."""
        trajectory, config = state.trajectory, self.config
        left = config.max_response_tokens - len(trajectory.response_token_ids)
        tokens, logprobs = generation.response_token_ids[:left], generation.logprobs[:left]
        state.extend(tokens, logprobs)
        trajectory.num_turns += 1
        version = generation.weight_version
        if trajectory.weight_version < 0 or version < trajectory.weight_version:
            trajectory.weight_version = version
        ended = bool(tokens) and tokens[-1] in self.stop_token_ids
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
        trajectory.messages.append({"role": "assistant", "content": text})
        if len(generation.response_token_ids) > left:
            state.finish("max_response_tokens", cut=True)
            return []
        if generation.finish_reason != "stop":
            state.finish("turn_length", cut=True)
            return []
        calls, failure = parse_turn(self.parser, text)
        trajectory.num_parser_failures += failure is not None
        if not calls:
            if state.environment is None:
                state.finish("answered")
            return []
        if trajectory.num_turns >= config.max_turns:
            state.finish("max_turns")
            return []
        if trajectory.num_tool_calls + len(calls) > config.max_tool_calls:
            state.finish("max_tool_calls")
            return []
        return calls

    def _run_tools(self, calling: list[tuple[AgentState, list[ToolCall]]]) -> None:
        for state, calls in calling:
            for call in calls:
                call.context = dict(state.tools_kwargs.get(call.name) or {})
        results = iter(self.tools.run([call for _, calls in calling for call in calls]))
        for state, calls in calling:
            trajectory = state.trajectory
            messages = []
            for call in calls:
                result = next(results)
                trajectory.num_tool_calls += 1
                if call.error is None and call.name in trajectory.tool_calls_by_name:
                    trajectory.tool_calls_by_name[call.name] += 1
                else:
                    trajectory.num_invalid_tool_calls += 1
                trajectory.num_tool_errors += result.status == "error"
                trajectory.num_tool_timeouts += result.status == "timeout"
                messages.append({"role": "tool", "name": call.name, "content": result.output})
            self._append(state, messages)

    def _step_environment(self, state: AgentState) -> None:
        trajectory = state.trajectory
        try:
            observation, reward, done = state.environment.step([dict(m) for m in trajectory.messages])
            trajectory.env_reward += float(reward)
            last_policy_token = _last_policy_token(trajectory.loss_mask)
            if last_policy_token is not None:
                trajectory.turn_rewards.append((last_policy_token, float(reward)))
            messages = as_messages(observation)
        except Exception:  # counted; the trajectory ends here
            trajectory.num_env_errors += 1
            state.finish("env_error")
            return
        if done:
            state.finish("env_done")
        elif trajectory.num_turns >= self.config.max_turns:
            state.finish("max_turns")
        else:
            self._append(state, messages)

    def _append(self, state: AgentState, messages: list[dict]) -> None:
        """The messages' tokens after the policy's last turn, masked; over the budget the trajectory ends instead."""
        trajectory = state.trajectory
        glue = self.chat.glue_ids(trajectory.messages, messages)
        trajectory.messages.extend(messages)
        if len(trajectory.response_token_ids) + len(glue) >= self.config.max_response_tokens:
            state.finish("max_response_tokens", cut=True)  # no room for them and a turn after them
            return
        state.extend(glue, None)

    def close(self) -> None:
        self.tools.close()


def episode_info(trajectory: Trajectory) -> dict[str, Any]:
    """What a reward function finds in ``extra_info["agent"]``: the last policy turn's text (``final_answer``),
    the conversation's messages and the trajectory's counts."""
    answers = [m["content"] for m in trajectory.messages if m.get("role") == "assistant"]
    return {"final_answer": answers[-1] if answers else "", "messages": trajectory.messages,
            "num_turns": trajectory.num_turns, "num_tool_calls": trajectory.num_tool_calls,
            "num_tool_errors": trajectory.num_tool_errors + trajectory.num_tool_timeouts,
            "env_reward": trajectory.env_reward, "turn_rewards": list(trajectory.turn_rewards),
            "stop_reason": trajectory.stop_reason}


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``agent/...`` metrics of a step's trajectories: turns, tool calls (per tool), errors, timeouts (counts and
    rates per call), policy and masked tokens, why they ended."""
    count = max(len(trajectories), 1)
    tokens = sum(len(t.loss_mask) for t in trajectories)
    masked = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories)
    num_calls = sum(t.num_tool_calls for t in trajectories)
    metrics = {
        "agent/turns_mean": sum(t.num_turns for t in trajectories) / count,
        "agent/turns_max": float(max((t.num_turns for t in trajectories), default=0)),
        "agent/tool_calls_mean": sum(t.num_tool_calls for t in trajectories) / count,
        "agent/tool_calls": float(sum(t.num_tool_calls for t in trajectories)),
        "agent/tool_errors": float(sum(t.num_tool_errors for t in trajectories)),
        "agent/tool_timeouts": float(sum(t.num_tool_timeouts for t in trajectories)),
        "agent/tool_error_rate": sum(t.num_tool_errors for t in trajectories) / max(num_calls, 1),
        "agent/tool_timeout_rate": sum(t.num_tool_timeouts for t in trajectories) / max(num_calls, 1),
        "agent/tool_calls_invalid": float(sum(t.num_invalid_tool_calls for t in trajectories)),
        "agent/parser_failures": float(sum(t.num_parser_failures for t in trajectories)),
        "agent/env_errors": float(sum(t.num_env_errors for t in trajectories)),
        "agent/env_reward_mean": sum(t.env_reward for t in trajectories) / count,
        "agent/policy_tokens_mean": (tokens - masked) / count,
        "agent/masked_tokens_mean": masked / count,
        "agent/masked_tokens": float(masked),
        "agent/masked_token_fraction": masked / max(tokens, 1),
    }
    for name in sorted({name for t in trajectories for name in t.tool_calls_by_name}):
        metrics[f"agent/tool_calls/{name}"] = float(sum(t.tool_calls_by_name.get(name, 0) for t in trajectories))
    for reason in STOP_REASONS:
        metrics[f"agent/stop/{reason}"] = sum(t.stop_reason == reason for t in trajectories) / count
    return metrics

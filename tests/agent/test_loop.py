"""The agent loop with a scripted generator: turns batched over trajectories, tool outputs appended as masked
tokens, and every way a trajectory ends (answer, turn / tool / token budget, environment done), with its counts."""

import re

import pytest

from rlmega.agent.config import AgentConfig
from rlmega.agent.loop import AgentLoop, agent_metrics, episode_info
from rlmega.data import build_char_tokenizer
from rlmega.rollout.protocol import SamplingParams

from .helpers import FakeTools, ScriptedGenerator, logprob_of, record

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 5}}</tool_call>'


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def turns(*texts: str):
    """A generator that answers the k-th call with ``texts[k]`` followed by EOS (for every trajectory)."""
    return ScriptedGenerator(lambda context, call: encode(texts[min(call, len(texts) - 1)]) + [EOS], [EOS])


def loop(tools=None, environment=None, **settings) -> AgentLoop:
    config = AgentConfig(enabled=True, **{"max_turns": 4, "max_response_tokens": 1000, **settings})
    tools = tools or FakeTools({"add": lambda a, b: str(a + b)})
    return AgentLoop(config, TOKENIZER, stop_token_ids=[EOS], tools=tools, environment_factory=environment)


PARAMS = SamplingParams(max_new_tokens=300, stop_token_ids=(EOS,), n=2, seed=5)


def test_a_tool_call_then_an_answer():
    generator = turns(CALL, "8")
    trajectories = loop().run(generator, [record("3+5="), record("1+1=", index=1)], PARAMS)
    assert len(trajectories) == 4 and [t.prompt_index for t in trajectories] == [0, 0, 1, 1]
    # Each turn is one generation call over all live trajectories.
    assert [len(contexts) for contexts, _ in generator.calls] == [4, 4]
    assert [params.seed for _, params in generator.calls] == [5, 5 + 1_000_003]
    for trajectory in trajectories:
        assert (trajectory.num_turns, trajectory.num_tool_calls, trajectory.stop_reason) == (2, 1, "answered")
        text = TOKENIZER.decode(trajectory.response_token_ids, skip_special_tokens=False)
        assert text == CALL + "<eos><|tool|>8<eos><|assistant|>8<eos>"
        first, glue, second = len(encode(CALL)) + 1, len(encode("<|tool|>8<eos><|assistant|>")), 2
        assert trajectory.loss_mask == [1] * first + [0] * glue + [1] * second
        assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask) if m == 0)
        assert trajectory.finish_reason == "stop" and trajectory.weight_version == 3
        assert episode_info(trajectory)["final_answer"] == "8"
    metrics = agent_metrics(trajectories)
    assert metrics["agent/turns_mean"] == 2 and metrics["agent/tool_calls"] == 4
    assert metrics["agent/stop/answered"] == 1.0 and metrics["agent/masked_tokens"] == 4 * glue


def test_the_turn_budget_ends_a_trajectory_that_keeps_calling():
    tools = FakeTools({"add": lambda a, b: str(a + b)})
    trajectories = loop(tools, max_turns=3).run(turns(CALL), [record("3+5=")], PARAMS)
    for trajectory in trajectories:
        # The third turn's call is not run: there is no turn left to read its output.
        assert (trajectory.num_turns, trajectory.num_tool_calls, trajectory.stop_reason) == (3, 2, "max_turns")
    assert len(tools.calls) == 4


def test_the_tool_call_budget():
    two_calls = CALL + CALL
    trajectory = loop(max_tool_calls=3).run(turns(two_calls), [record("3+5=")], PARAMS)[0]
    assert (trajectory.num_turns, trajectory.num_tool_calls, trajectory.stop_reason) == (2, 2, "max_tool_calls")


def test_the_token_budget_cuts_the_turn_that_reaches_it():
    budget = 100
    trajectory = loop(max_response_tokens=budget).run(turns(CALL), [record("3+5=")], PARAMS)[0]
    assert len(trajectory.response_token_ids) == budget == len(trajectory.loss_mask) == len(trajectory.logprobs)
    assert (trajectory.stop_reason, trajectory.finish_reason) == ("max_response_tokens", "length")
    assert trajectory.loss_mask[-1] == 1  # cut inside the policy's second turn


def test_tool_output_that_does_not_fit_ends_the_trajectory():
    tools = FakeTools({"add": lambda a, b: "9" * 200})
    trajectory = loop(tools, max_response_tokens=150).run(turns(CALL), [record("3+5=")], PARAMS)[0]
    assert (trajectory.num_turns, trajectory.stop_reason) == (1, "max_response_tokens")
    assert trajectory.finish_reason == "length"
    assert trajectory.loss_mask == [1] * len(trajectory.loss_mask)  # nothing of the output was appended


def test_a_turn_cut_by_max_new_tokens_ends_the_trajectory():
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,), n=1)
    trajectory = loop().run(turns(CALL), [record("3+5=")], params)[0]
    assert (trajectory.num_turns, trajectory.stop_reason, trajectory.finish_reason) == (1, "turn_length", "length")


def test_errors_and_timeouts_are_answers_and_counted():
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{oops}</tool_call>'
    slow = '<tool_call>{"name": "slow", "arguments": {}}</tool_call>'
    generator = turns(bad, slow, "done")
    tools = FakeTools({"add": lambda a, b: str(a + b), "slow": lambda: "never"})
    trajectories = loop(tools).run(generator, [record("3+5=")], SamplingParams(max_new_tokens=300,
                                                                              stop_token_ids=(EOS,)))
    trajectory = trajectories[0]
    assert (trajectory.num_tool_calls, trajectory.num_tool_errors, trajectory.num_tool_timeouts) == (3, 2, 1)
    assert trajectory.stop_reason == "answered"
    contents = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "missing 1 required positional argument: 'b'" in contents[0] and "not valid JSON" in contents[1]
    assert "timed out" in contents[2]
    metrics = agent_metrics(trajectories)
    assert (metrics["agent/tool_errors"], metrics["agent/tool_timeouts"]) == (2, 1)


class Guess:
    """Says higher / lower until the policy names the number; rewards the right guess."""

    def reset(self, example):
        self.target = example["ground_truth"]
        return [{"role": "user", "content": "guess a digit"}]

    def step(self, messages):
        guess = messages[-1]["content"]
        if guess == self.target:
            return None, 1.0, True
        return ("higher" if guess < self.target else "lower"), -0.25, False


def test_an_environment_answers_turns_until_done():
    generator = turns("3", "9", "7")
    trajectory = loop(environment=Guess).run(generator, [record("ignored", ground_truth="7")],
                                             SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,)))[0]
    assert (trajectory.num_turns, trajectory.stop_reason, trajectory.env_reward) == (3, "env_done", 0.5)
    assert TOKENIZER.decode(trajectory.prompt_token_ids, skip_special_tokens=False).endswith(
        "<|user|>guess a digit<eos><|assistant|>")
    text = TOKENIZER.decode(trajectory.response_token_ids, skip_special_tokens=False)
    assert text == "3<eos><|user|>higher<eos><|assistant|>9<eos><|user|>lower<eos><|assistant|>7<eos>"


def test_an_environment_that_never_ends_stops_at_the_turn_budget_and_a_broken_one_is_counted():
    trajectory = loop(environment=Guess, max_turns=2).run(turns("1"), [record("x", ground_truth="7")],
                                                          SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,)))[0]
    assert (trajectory.num_turns, trajectory.stop_reason, trajectory.env_reward) == (2, "max_turns", -0.5)

    class Broken(Guess):
        def step(self, messages):
            raise ValueError("bug")

    trajectories = loop(environment=Broken).run(turns("1"), [record("x", ground_truth="7")], PARAMS)
    assert [t.stop_reason for t in trajectories] == ["env_error"] * 2
    assert agent_metrics(trajectories)["agent/env_errors"] == 2


@pytest.mark.parametrize("field, value", [("max_turns", 0), ("max_response_tokens", -1), ("tool_timeout_s", 0)])
def test_config_values_are_checked(field, value):
    with pytest.raises(ValueError, match=f"agent.{field}: must be"):
        AgentConfig(**{field: value})


def test_logprobs_are_the_engines_own():
    generator = turns(CALL, "8")
    trajectory = loop().run(generator, [record("3+5=")], SamplingParams(max_new_tokens=300,
                                                                        stop_token_ids=(EOS,)))[0]
    prompt = len(trajectory.prompt_token_ids)
    for position, (token, logprob, mask) in enumerate(zip(trajectory.response_token_ids, trajectory.logprobs,
                                                           trajectory.loss_mask)):
        assert logprob == (logprob_of(prompt + position, token) if mask else 0.0)


def test_parts_by_path_and_their_checks(tmp_path):
    (tmp_path / "my_env.py").write_text(
        "class Echo:\n"
        "    def reset(self, example):\n        return 'say ' + example['ground_truth']\n"
        "    def step(self, messages):\n        return None, float(messages[-1]['content'] == 'hi'), True\n")
    config = AgentConfig(enabled=True, environment=f"{tmp_path}/my_env.py:Echo",
                         parser="rlmega.agent.parsers:hermes_parser")
    agent = AgentLoop(config, TOKENIZER, stop_token_ids=[EOS], tools=FakeTools({}))
    trajectory = agent.run(turns("hi"), [record("x", ground_truth="hi")], PARAMS)[0]
    assert (trajectory.env_reward, trajectory.stop_reason) == (1.0, "env_done")
    assert trajectory.messages[0]["content"] == "say hi"
    for settings, message in [({"environment": f"{tmp_path}/my_env.py:Missing"}, "has no function Missing"),
                              ({"tools": ["calculator", "calculator"]}, "names a tool twice"),
                              ({"parser": "json"}, "a built-in parser (hermes) or 'module:function'"),
                              ({"scored_text": "all"}, "agent.scored_text")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            AgentConfig(enabled=True, **settings)

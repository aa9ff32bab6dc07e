"""verl's multi-turn rows read as they are (``extra_info.tools_kwargs`` to the tools, ``interaction_kwargs`` to the
environment), and the agent's per-tool, per-call and per-token metrics."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlmega.agent.config import AgentConfig
from rlmega.agent.loop import AgentLoop, agent_metrics
from rlmega.agent.parsers import ToolCall
from rlmega.agent.tools import ToolBox, schema_of
from rlmega.data import build_char_tokenizer
from rlmega.data.dataset import DataConfig, PromptDataset
from rlmega.data.schema import DataFormatError, PromptRecord
from rlmega.rollout.protocol import SamplingParams

from .helpers import FakeTools, ScriptedGenerator

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
PARAMS = SamplingParams(max_new_tokens=300, stop_token_ids=(EOS,))

# A row as verl's multi-turn GSM8K preprocessing writes it (tool_agent loop, one reward tool, an interaction).
VERL_ROW = {
    "data_source": "openai/gsm8k",
    "agent_name": "tool_agent",
    "prompt": [{"role": "system", "content": "You are a math expert."}, {"role": "user", "content": "3+5="}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "8"},
    "extra_info": {
        "split": "train", "index": 0, "need_tools_kwargs": True,
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "8"}}},
        "interaction_kwargs": {"name": "gsm8k", "query": "3+5=", "ground_truth": "8"},
    },
}


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def turns(*texts: str) -> ScriptedGenerator:
    return ScriptedGenerator(lambda context, call: encode(texts[min(call, len(texts) - 1)]) + [EOS], [EOS])


def call_text(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def agent_loop(tools, environment=None, **settings) -> AgentLoop:
    config = AgentConfig(enabled=True, **{"max_turns": 4, "max_response_tokens": 1000, **settings})
    return AgentLoop(config, TOKENIZER, stop_token_ids=[EOS], tools=tools, environment_factory=environment)


def verl_record(extra_info: dict) -> PromptRecord:
    return PromptRecord(index=0, prompt_token_ids=[], messages=VERL_ROW["prompt"], data_source="openai/gsm8k",
                        ground_truth="8", extra_info=extra_info)


class ContextTools(FakeTools):
    """Fake tools that also record the context each call carried."""

    def run(self, calls):
        self.contexts = getattr(self, "contexts", []) + [dict(call.context) for call in calls]
        return super().run(calls)


# ------------------------------------------------------------------------------------------------- rows


def test_a_verl_multi_turn_row_loads_with_its_kwargs(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(VERL_ROW) + "\n")
    record = PromptDataset(DataConfig(files=[str(path)], max_prompt_length=512), TOKENIZER)[0]
    assert record.messages == VERL_ROW["prompt"] and record.ground_truth == "8"
    assert record.extra_info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "8"}}}
    assert record.extra_info["interaction_kwargs"]["name"] == "gsm8k"


def test_a_verl_multi_turn_row_loads_from_parquet(tmp_path):
    from rlmega.data.files import write_rows

    path = write_rows([VERL_ROW], tmp_path / "train.parquet")
    record = PromptDataset(DataConfig(files=[path], max_prompt_length=512), TOKENIZER)[0]
    assert record.extra_info["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "8"}
    assert record.extra_info["interaction_kwargs"]["query"] == "3+5="


@pytest.mark.parametrize("field, value, message", [
    ("tools_kwargs", ["calc"], "extra_info.tools_kwargs"),
    ("tools_kwargs", {"calc": 3}, "extra_info.tools_kwargs"),
    ("interaction_kwargs", "gsm8k", "extra_info.interaction_kwargs"),
])
def test_malformed_multi_turn_kwargs_name_the_field(tmp_path, field, value, message):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({**VERL_ROW, "extra_info": {**VERL_ROW["extra_info"], field: value}}) + "\n")
    with pytest.raises(DataFormatError, match=message):
        PromptDataset(DataConfig(files=[str(path)], max_prompt_length=512), TOKENIZER)


# ------------------------------------------------------------------------------------- tools_kwargs


def test_each_call_carries_its_tools_kwargs_entry():
    tools = ContextTools({"calc_gsm8k_reward": lambda answer: "ok", "add": lambda a, b: str(a + b)})
    generator = turns(call_text("calc_gsm8k_reward", answer="8") + call_text("add", a=1, b=2), "8")
    agent_loop(tools).run(generator, [verl_record(VERL_ROW["extra_info"])], PARAMS)
    assert tools.contexts == [{"create_kwargs": {"ground_truth": "8"}}, {}]  # a tool the row does not name: {}
    tools = ContextTools({"add": lambda a, b: str(a + b)})
    agent_loop(tools).run(turns(call_text("add", a=1, b=2), "3"), [verl_record({})], PARAMS)
    assert tools.contexts == [{}]  # a row without tools_kwargs


TOOL_FILE = textwrap.dedent('''
    def grade(answer: str, context: dict) -> str:
        """Compare the answer with the row's ground truth."""
        truth = context["create_kwargs"]["ground_truth"]
        return "correct" if answer == truth else f"wrong, not {truth}"

    def plain(x: int) -> str:
        return str(x)
''')


def test_a_tool_that_declares_context_gets_the_rows_kwargs_in_its_worker(tmp_path):
    (tmp_path / "grading.py").write_text(TOOL_FILE)
    specs = [f"{tmp_path}/grading.py:grade", f"{tmp_path}/grading.py:plain"]
    with ToolBox(specs, num_workers=1, timeout_s=5.0, memory_mb=512, max_output_chars=200) as box:
        grade_schema = box.schemas[0]["function"]["parameters"]
        assert list(grade_schema["properties"]) == ["answer"] and grade_schema["required"] == ["answer"]
        context = {"create_kwargs": {"ground_truth": "8"}}
        forged = {"answer": "8", "context": {"create_kwargs": {"ground_truth": "8"}}}
        results = box.run([ToolCall("grade", {"answer": "8"}, context=context),
                           ToolCall("grade", {"answer": "7"}, context=context),
                           ToolCall("grade", forged, context={"create_kwargs": {"ground_truth": "9"}}),
                           ToolCall("plain", {"x": 4}, context=context)])
    assert [result.output for result in results] == ["correct", "wrong, not 8", "wrong, not 9", "4"]


def test_context_is_not_in_a_signature_schema():
    def lookup(city: str, context: dict, year: int = 2024) -> str:
        """Population."""

    parameters = schema_of(lookup)["function"]["parameters"]
    assert list(parameters["properties"]) == ["city", "year"] and parameters["required"] == ["city"]


# --------------------------------------------------------------------------------- interaction_kwargs


class Interaction:
    """verl-style interaction: the query and the answer come from the row's interaction_kwargs."""

    def reset(self, example):
        self.kwargs = example["interaction_kwargs"]
        return self.kwargs["query"]

    def step(self, messages):
        right = messages[-1]["content"] == self.kwargs["ground_truth"]
        return (None if right else "try again"), float(right), right


def test_the_environment_reset_gets_interaction_kwargs():
    trajectory = agent_loop(FakeTools({}), environment=Interaction).run(
        turns("7", "8"), [verl_record(VERL_ROW["extra_info"])], PARAMS)[0]
    assert trajectory.messages[0] == {"role": "user", "content": "3+5="}
    assert (trajectory.num_turns, trajectory.stop_reason, trajectory.env_reward) == (2, "env_done", 1.0)
    seen = []

    class Recording(Interaction):
        def reset(self, example):
            seen.append(example["interaction_kwargs"])

        def step(self, messages):
            return None, 0.0, True

    agent_loop(FakeTools({}), environment=Recording).run(turns("x"), [verl_record({})], PARAMS)
    assert seen == [{}]


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_per_tool_per_call_and_per_token():
    tools = FakeTools({"add": lambda a, b: str(a + b), "mul": lambda a, b: str(a * b), "slow": lambda: "never",
                       "unused": lambda: ""})
    first = call_text("add", a=1, b=2) + call_text("mul", a=2, b=3) + call_text("add", a=1)  # the last one errs
    second = call_text("slow") + "<tool_call>{oops}</tool_call>" + call_text("nope")
    generator = turns(first, second, "done")
    trajectories = agent_loop(tools).run(generator, [verl_record({})], SamplingParams(
        max_new_tokens=300, stop_token_ids=(EOS,), n=2))
    trajectory = trajectories[0]
    assert trajectory.tool_calls_by_name == {"add": 2, "mul": 1, "slow": 1, "unused": 0}
    assert (trajectory.num_tool_calls, trajectory.num_invalid_tool_calls) == (6, 2)
    assert (trajectory.num_tool_errors, trajectory.num_tool_timeouts) == (3, 1)  # missing b, bad JSON, no tool
    metrics = agent_metrics(trajectories)
    assert {name: value for name, value in metrics.items() if name.startswith("agent/tool_calls/")} == {
        "agent/tool_calls/add": 4.0, "agent/tool_calls/mul": 2.0, "agent/tool_calls/slow": 2.0,
        "agent/tool_calls/unused": 0.0}
    assert metrics["agent/tool_calls"] == 12 and metrics["agent/tool_calls_mean"] == 6
    assert metrics["agent/tool_calls_invalid"] == 4
    assert metrics["agent/tool_error_rate"] == 6 / 12 and metrics["agent/tool_timeout_rate"] == 2 / 12
    policy = sum(trajectory.loss_mask)
    masked = len(trajectory.loss_mask) - policy
    assert metrics["agent/policy_tokens_mean"] == policy and metrics["agent/masked_tokens_mean"] == masked
    assert metrics["agent/masked_token_fraction"] == masked / (policy + masked)
    assert metrics["agent/stop/answered"] == 1.0


def test_metrics_of_how_trajectories_end_sum_to_one():
    tools = FakeTools({"add": lambda a, b: str(a + b)})
    call = call_text("add", a=1, b=2)
    runs = [agent_loop(tools).run(turns("8"), [verl_record({})], PARAMS),                       # answered
            agent_loop(tools, max_turns=2).run(turns(call), [verl_record({})], PARAMS),         # max_turns
            agent_loop(tools, max_tool_calls=1).run(turns(call + call), [verl_record({})], PARAMS),
            agent_loop(tools, max_response_tokens=5).run(turns(call), [verl_record({})], PARAMS)]
    trajectories = [trajectory for run in runs for trajectory in run]
    assert [t.stop_reason for t in trajectories] == ["answered", "max_turns", "max_tool_calls", "max_response_tokens"]
    metrics = agent_metrics(trajectories)
    stops = {name: value for name, value in metrics.items() if name.startswith("agent/stop/")}
    assert sum(stops.values()) == 1.0
    assert stops["agent/stop/answered"] == stops["agent/stop/max_turns"] == 0.25
    assert stops["agent/stop/max_tool_calls"] == stops["agent/stop/max_response_tokens"] == 0.25
    assert agent_metrics([])["agent/tool_error_rate"] == 0.0

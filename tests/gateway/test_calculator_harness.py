"""The tool-use quickstart through the gateway (``configs/tiny_cpu_tools_gateway.yaml``): the ``openai`` script of
``rlmega.gateway.examples.calculator`` calls the calculator, sends its result back as a tool message, and the
trajectory the gateway records is, id for id, the agent loop's for the same exchange; the warm-start's
demonstrations, played through the harness, are the agent loop's demonstrations and the gateway's rollouts of the
demonstrated answers; two GRPO steps train with no session lost."""

import json
import subprocess
import sys

import pytest

from agent.helpers import FakeTools, ScriptedGenerator
from rlmega.agent.builtin import calculator
from rlmega.agent.config import AgentConfig
from rlmega.agent.examples import calculator_demonstration
from rlmega.agent.loop import AgentLoop, example_of
from rlmega.config import load_config
from rlmega.data import build_char_tokenizer
from rlmega.data.schema import PromptRecord
from rlmega.errors import UserError
from rlmega.gateway.config import GatewayConfig
from rlmega.gateway.harness import HarnessLoop
from rlmega.rollout.protocol import SamplingParams
from rlmega.trainer.prompt_side import build_prompt_side

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
PARSER = "rlmega.agent.examples:equals_calculator"
HARNESS = "rlmega.gateway.examples:calculator"


def _encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _record(expression: str, answer: str, index: int = 0) -> PromptRecord:
    messages = [{"role": "user", "content": expression}]
    prompt = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return PromptRecord(index=index, prompt_token_ids=_encode(prompt), messages=messages, data_source="arithmetic",
                        ground_truth=answer)


def _sum(expression: str) -> int:
    return sum(int(term) for term in expression.split("+"))


def _plays_the_answer(context: list[int], call: int) -> list[int]:
    """The demonstrated answer: the prompt's expression (a calculator call), then what the tool message says."""
    text = TOKENIZER.decode(context, skip_special_tokens=False)
    if "<|tool|>" in text:
        return _encode(text.split("<|tool|>")[1].split("<eos>")[0]) + [EOS]
    return _encode(text.split("<|user|>")[1].split("<eos>")[0]) + [EOS]


def _agent_loop() -> AgentLoop:
    """The built-in loop as configs/tiny_cpu_tools.yaml runs it (the real calculator, in this process)."""
    config = AgentConfig(enabled=True, tools=["calculator"], parser=PARSER, max_turns=2, max_tool_calls=1,
                         max_response_tokens=32, max_tool_output_chars=8)
    return AgentLoop(config, TOKENIZER, stop_token_ids=[EOS], tools=FakeTools({"calculator": calculator}))


@pytest.fixture
def harness_loop():
    made = []

    def make(harness: str = HARNESS) -> HarnessLoop:
        made.append(HarnessLoop(GatewayConfig(enabled=True, harness=harness, parser=PARSER, session_timeout_s=60),
                                TOKENIZER, stop_token_ids=[EOS]))
        return made[-1]

    yield make
    for loop in made:
        loop.close()


PARAMS = SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,), n=2, seed=3)


def test_the_script_calls_the_calculator_and_records_the_agent_loops_tokens(harness_loop):
    records = [_record("37+48=", "85"), _record("9+91=", "100", index=1)]
    engine = ScriptedGenerator(_plays_the_answer, [EOS])
    played = harness_loop().run(engine, records, PARAMS)
    looped = _agent_loop().run(ScriptedGenerator(_plays_the_answer, [EOS]), records, PARAMS)
    assert len(played) == len(looped) == 4
    for through_gateway, in_loop in zip(played, looped):
        assert not through_gateway.lost and through_gateway.num_turns == 2
        messages = through_gateway.messages
        # The reply "37+48=" came back as an OpenAI tool call, and the script answered it with the sum.
        (call,) = messages[1]["tool_calls"]
        assert call["function"]["name"] == "calculator"
        total = str(_sum(json.loads(call["function"]["arguments"])["expression"]))
        assert messages[2] == {"role": "tool", "tool_call_id": call["id"], "content": total}
        assert messages[3]["content"] == total and "tool_calls" not in messages[3]
        assert through_gateway.prompt_token_ids == in_loop.prompt_token_ids
        assert through_gateway.response_token_ids == in_loop.response_token_ids
        assert through_gateway.loss_mask == in_loop.loss_mask
        assert through_gateway.logprobs == in_loop.logprobs
    text = TOKENIZER.decode(played[0].response_token_ids, skip_special_tokens=False)
    assert text == "37+48=<eos><|tool|>85<eos><|assistant|>85<eos>"


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=16, num_val=4, max_operand=99)


def test_the_warm_starts_demonstrations_are_the_gateways_trajectories(tmp_path, assets):
    (tmp_path / "assets").symlink_to(assets)
    config = load_config("tiny_cpu_tools_gateway", [f"run_dir={tmp_path}", "trainer.prompts_per_step=2",
                                                    "rollout.n=2", "trainer.sft_steps=1"])
    prompts = build_prompt_side(config)
    try:
        tokenizer, harness = prompts.data.tokenizer, prompts.generator.agent
        records = prompts.data.dataset.batch(list(range(4)))
        turns = [calculator_demonstration(example_of(record)) for record in records]
        demonstrated = harness.demonstrate(records, turns)
        engine = ScriptedGenerator(_plays_the_answer, [tokenizer.eos_token_id])
        params = SamplingParams(max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), n=1, seed=1)
        played = harness.run(engine, records, params)
        looped = _agent_loop().demonstrate(records, turns)
        for shown, rollout, in_loop in zip(demonstrated, played, looped):
            assert shown.prompt_token_ids == rollout.prompt_token_ids == in_loop.prompt_token_ids
            assert shown.response_token_ids == rollout.response_token_ids == in_loop.response_token_ids
            assert shown.loss_mask == rollout.loss_mask == in_loop.loss_mask
        # The rule scores the last answer (gateway.scored_text: final_answer): every played answer is right.
        scores, _ = prompts.scorer.score(records, played)
        assert scores.tolist() == [1.0] * 4
        # The warm-start trains on such sequences, its loss on the policy's turns only.
        (batch,) = list(prompts.warm_start.batches())
        eos = tokenizer.eos_token
        for tokens, prompt, mask in zip(batch.tokens, batch.prompt_lengths, batch.fields["response_mask"]):
            text = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
            expression = text.split("<|user|>")[1].split(eos)[0]
            total = _sum(expression[:-1])
            assert text.endswith(f"<|assistant|>{expression}{eos}<|tool|>{total}{eos}<|assistant|>{total}{eos}")
            kept = [token for token, m in zip(tokens[prompt:].tolist(), mask.tolist()) if m]
            assert tokenizer.decode(kept, skip_special_tokens=False) == f"{expression}{eos}{total}{eos}"
    finally:
        prompts.close()


def test_a_harness_that_fails_on_a_demonstration_names_the_row(tmp_path, harness_loop):
    script = tmp_path / "broken.py"
    script.write_text("def run(base_url, example):\n    raise RuntimeError('no network here')\n")
    with pytest.raises(UserError, match=r"^gateway.demonstration: the harness failed on the demonstration of row 7: "
                                        "no network here$"):
        harness_loop(f"{script}:run").demonstrate([_record("1+2=", "3", index=7)], [["1+2=", "3"]])


@pytest.mark.timeout(400)
def test_two_grpo_steps_through_the_calculator_script_lose_no_session(tmp_path, assets):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "assets").symlink_to(assets)
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu_tools_gateway",
               f"run_dir={run_dir}", "trainer.prompts_per_step=4", "rollout.n=2", "trainer.sft_steps=2",
               "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
               "layout.tp=1", "layout.world_size=1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "warm-start 2/2" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["gateway/lost_sessions"] == 0 and row["gateway/extra_segments"] == 0
        assert row["gateway/calls_mean"] >= 1
        assert row["mismatch/abs_log_prob_diff_max"] < 1e-3

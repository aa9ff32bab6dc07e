"""The loop on the transformers engine: a forward pass over the trained sequence gives, at every policy token,
the log-prob the engine sampled it with (the sequence is what the engine saw), and a seeded run repeats."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmega.agent.config import AgentConfig
from rlmega.agent.loop import AgentLoop
from rlmega.agent.tools import ToolBox
from rlmega.rollout.hf_engine import HFEngine
from rlmega.rollout.protocol import SamplingParams
from rlmega.trainer.assets import prepare_tiny_assets

from .helpers import record


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """``[R]`` log_softmax(logits / temperature) of each response token, from one forward pass of the sequence."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


PARSER = f"{Path(__file__).resolve().parent / 'agent_parts.py'}:always_calculate"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    model_dir = prepare_tiny_assets(tmp_path_factory.mktemp("assets"), num_train=8, num_val=4)["model"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AgentConfig(enabled=True, tools=["calculator"], parser=PARSER, max_turns=3, max_response_tokens=50,
                         max_tool_output_chars=2, num_tool_workers=1)
    # A random model rarely samples its end-of-turn token: every token ends a turn here, so turns are one token.
    stops = tuple(range(len(tokenizer)))
    with ToolBox(config.tools, num_workers=1, timeout_s=5.0, memory_mb=512, max_output_chars=2) as tools:
        agent = AgentLoop(config, tokenizer, stop_token_ids=stops, tools=tools)
        yield agent, HFEngine(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer, stops


def test_policy_tokens_keep_the_engines_logprobs(parts):
    agent, engine, model, tokenizer, stops = parts
    params = SamplingParams(temperature=0.8, max_new_tokens=3, stop_token_ids=stops, n=3, seed=11)
    records = [record("3+5="), record("2+2=", index=1)]
    trajectories = agent.run(engine, records, params)
    assert [(t.num_turns, t.num_tool_calls, t.stop_reason) for t in trajectories] == [(3, 2, "max_turns")] * 6
    for trajectory in trajectories:
        recomputed = teacher_forced_logprobs(model, trajectory.prompt_token_ids, trajectory.response_token_ids,
                                             temperature=0.8)
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        engine_logprobs = torch.tensor(trajectory.logprobs)
        assert torch.allclose(recomputed[mask], engine_logprobs[mask], atol=1e-4)
        assert (engine_logprobs[~mask] == 0).all()
    again = agent.run(engine, records, params)
    assert [t.response_token_ids for t in again] == [t.response_token_ids for t in trajectories]

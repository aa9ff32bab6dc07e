"""The agent loop inside the prompt side: a step's trajectories become the trainer's batch with the loss mask
on the policy's tokens only, the engine's log-probs beside them, scores of the final answers and agent metrics."""

import re

import pytest
import torch

from rlmega.config import load_config
from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.workers.heads import global_denominators

from .helpers import ScriptedGenerator, logprob_of


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    prepare_tiny_assets(run_dir / "assets", num_train=16, num_val=4)
    return run_dir


@pytest.fixture(scope="module")
def source(run_dir):
    config = load_config("tiny_cpu_agent", [f"run_dir={run_dir}", "trainer.val_every=0", "trainer.prompts_per_step=3",
                                            "rollout.n=2", "rollout.max_new_tokens=8"])
    source = build_prompt_side(config)
    yield source
    source.close()


def tool_using_policy(tokenizer):
    """Asks the calculator for the prompt's expression, then answers with the calculator's output."""
    eos = tokenizer.eos_token_id

    def respond(context, call):
        text = tokenizer.decode(context, skip_special_tokens=False)
        outputs = re.findall(r"<\|tool\|>(.*?)<eos>", text)
        answer = outputs[-1] if outputs else re.search(r"<\|user\|>(.*?)<eos>", text).group(1)
        return tokenizer.encode(answer, add_special_tokens=False) + [eos]

    return ScriptedGenerator(respond, [eos])


def test_trajectories_become_the_batch(source):
    generator = tool_using_policy(source.data.tokenizer)
    rollouts = source.step_rollouts.take(generator, step=1)
    batch = rollouts.batch
    assert len(batch.tokens) == 6 and rollouts.response_mask is not None
    for tokens, prompt_length, mask, logp in zip(batch.tokens, batch.prompt_lengths, rollouts.response_mask,
                                                 rollouts.rollout_logp):
        response = tokens[prompt_length:].tolist()
        assert len(response) == len(mask) == len(logp)
        text = source.data.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
        expression = re.search(r"<\|user\|>(.*?)<eos>", text).group(1)
        value = str(sum(int(term) for term in expression[:-1].split("+")))
        assert text.endswith(f"<|assistant|>{expression}<eos><|tool|>{value}<eos><|assistant|>{value}<eos>")
        glue = len(source.data.tokenizer.encode(f"<|tool|>{value}<eos><|assistant|>", add_special_tokens=False))
        first = len(expression) + 1
        assert mask.tolist() == [1.0] * first + [0.0] * glue + [1.0] * (len(value) + 1)
        expected = [logprob_of(prompt_length + t, token) if m else 0.0
                    for t, (token, m) in enumerate(zip(response, mask))]
        assert torch.allclose(logp, torch.tensor(expected))
    assert rollouts.scores.tolist() == [1.0] * 6  # the final answers, scored by the rule
    metrics = rollouts.metrics
    assert metrics["agent/turns_mean"] == 2 and metrics["agent/tool_calls"] == 6 and metrics["agent/tool_errors"] == 0
    masked = sum(int((m == 0).sum()) for m in rollouts.response_mask)
    assert metrics["agent/masked_tokens"] == masked > 0
    # The loss normalises by the policy's tokens only (what the actor's update receives as response_mask).
    denominators = global_denominators(batch.with_fields(response_mask=rollouts.response_mask))
    assert int(denominators.num_tokens) == sum(batch.response_lengths) - masked


def test_validation_runs_the_loop(source):
    source.validation.config.num_prompts = 2
    source.data.val_dataset = source.data.dataset
    metrics, _ = source.validation.run(tool_using_policy(source.data.tokenizer))
    assert metrics["val/accuracy"] == 1.0


def test_a_loop_without_the_chat_template_is_refused(run_dir):
    from rlmega.errors import UserError

    config = load_config("tiny_cpu_agent", [f"run_dir={run_dir}", "trainer.val_every=0",
                                            "trainer.prompts_per_step=3", "data.use_chat_template=false"])
    with pytest.raises(UserError, match=re.escape("needs data.use_chat_template=true")):
        build_prompt_side(config)


def test_dapo_overlong_shaping_measures_the_whole_response(source):
    from rlmega.agent.loop import Trajectory

    source.scorer.config.overlong_buffer_length = 10
    try:
        long = Trajectory(0, [1] * 35, [0.0] * 35, "stop", 0)
        assert source.scorer.shape_scores(torch.tensor([1.0]), [long]).item() == pytest.approx(0.5)  # 5 of the last 10
    finally:
        source.scorer.config.overlong_buffer_length = 0

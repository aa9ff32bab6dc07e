"""Multi-turn trajectories in the asynchronous modes, driven with fake engines (no Ray) and the real calculator tool:
every trajectory takes its two turns (a calculator call, then the answer), interrupted turns continue with newer
weights, each token keeps the version that produced it, the staleness bound holds over whole trajectories, and the
tool output and glue stay masked; one-step-off accepts the same trajectories."""

import re

import pytest
import torch

from rlmega.config import load_config
from rlmega.rollout.protocol import Generation
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import PromptSide, build_prompt_side

from tests.trainer.fakes import (ROLLOUT_LOGP, FakeActor, FakeAsyncEngines, FakeEngines, FakeJob, MidGenerationActor,
                                 RecordedTakes)

N, PROMPTS, STEPS = 2, 2, 5


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


def _config(tmp_path, assets, *overrides):
    (tmp_path / "assets").symlink_to(assets)
    return load_config("tiny_cpu_tools", [
        f"run_dir={tmp_path}", f"trainer.total_steps={STEPS}", f"trainer.prompts_per_step={PROMPTS}",
        f"rollout.n={N}", "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
        "reward.num_workers=1", "metrics.backends=[jsonl]", "metrics.plot=false", "actor.ppo_mini_batches=1",
        "actor.policy_loss.kl_loss_coef=0", "trainer.fuse_old_logprob=false", "rollout.placement=disaggregated",
        "sync.post_sync_check=false", "cluster.timeout_s=60", *overrides])


def _turn_target(engine, prompt: list[int], request) -> list[int]:
    """A calculator user's turn: ``a+b=`` first, then (after the tool's output) the value; a third of the answers
    (by seed) are off by one. What a continuation already holds of the turn is not emitted again."""
    tokenizer = engine.tokenizer
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    a, b = re.findall(r"(\d+)\+(\d+)=", text)[0]
    begun = text.rsplit("<|assistant|>", 1)[1]
    if "<|tool|>" not in text:
        turn = f"{a}+{b}="
    else:
        right, wrong = str(int(a) + int(b)), str(int(a) + int(b) + 1)
        turn = (right if right.startswith(begun) else wrong) if begun else (wrong if request.seed % 3 == 0 else right)
    tokens = tokenizer.encode(turn, add_special_tokens=False) + [engine.stop_token_id]
    return tokens[len(tokenizer.encode(begun, add_special_tokens=False)):]


class CalculatorAsyncEngines(FakeAsyncEngines):
    target = _turn_target


class CalculatorEngines(FakeEngines):
    def generate(self, prompts, params):
        assert not self.asleep and params.n == 1
        self.calls.append(params)
        return [Generation(prompt_index=index, response_token_ids=tokens, logprobs=[ROLLOUT_LOGP] * len(tokens),
                           finish_reason="stop", weight_version=self.served)
                for index, tokens in enumerate(_turn_target(self, prompt, params) for prompt in prompts)]


def _check_trajectories(prompts: PromptSide, rollouts, staleness_bound=None, step=None):
    tokenizer = prompts.data.tokenizer
    for tokens, prompt_length, mask, versions, logp in zip(
            rollouts.batch.tokens, rollouts.batch.prompt_lengths, rollouts.response_mask, rollouts.token_versions,
            rollouts.rollout_logp):
        response = tokens[prompt_length:].tolist()
        text = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
        a, b = re.findall(r"(\d+)\+(\d+)=", text)[0]
        # Two turns: the call, the tool's output as a tool message, the answer (token in, token out).
        assert re.fullmatch(rf".*<\|assistant\|>{a}\+{b}=</s><\|tool\|>{int(a) + int(b)}</s><\|assistant\|>\d+</s>",
                            text.replace(tokenizer.eos_token, "</s>")), text
        assert len(mask) == len(response) == len(versions) == len(logp)
        # The mask is 1 on the two turns' tokens only: glue and the tool output are 0, with log-prob 0.
        policy = [token for token, m in zip(response, mask.tolist()) if m]
        first, second = tokenizer.decode(policy, skip_special_tokens=False).split(tokenizer.eos_token)[:2]
        assert first == f"{a}+{b}=" and second.isdigit()
        assert all(value == 0.0 for value, m in zip(logp.tolist(), mask.tolist()) if not m)
        if staleness_bound is not None:
            assert (step - 1) - int(versions.min()) <= staleness_bound


@pytest.mark.parametrize("staleness", [0, 1])
def test_async_trains_on_whole_multi_turn_trajectories_within_the_staleness_bound(tmp_path, assets, staleness):
    config = _config(tmp_path, assets, "rollout.mode=async", f"rollout.max_staleness={staleness}")
    prompts = build_prompt_side(config)
    engines = CalculatorAsyncEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], tick_s=0.02)
    actor = FakeActor()
    trainer = Trainer(config, prompts, FakeJob(), actor, engines)
    recording = RecordedTakes(trainer)
    assert trainer.fit() == 0
    assert sorted(recording.taken) == list(range(1, STEPS + 1)) and len(actor.updates) == STEPS
    for step, rollouts in recording.taken.items():
        assert len(rollouts.batch.tokens) == PROMPTS * N
        _check_trajectories(prompts, rollouts, staleness, step)
        assert rollouts.metrics["agent/tool_calls_mean"] == 1.0 and rollouts.metrics["agent/turns_mean"] == 2.0
        assert rollouts.metrics["agent/stop/answered"] == 1.0


def test_interrupted_turns_continue_with_newer_weights_and_keep_each_tokens_version(tmp_path, assets):
    config = _config(tmp_path, assets, "rollout.mode=async", "rollout.max_staleness=2",
                     "rollout.partial_rollout=continue")
    prompts = build_prompt_side(config)
    engines = CalculatorAsyncEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0], tick_s=0.3)
    actor = MidGenerationActor(engines)
    trainer = Trainer(config, prompts, FakeJob(), actor, engines)
    recording = RecordedTakes(trainer)
    assert trainer.fit() == 0
    assert engines.aborted > 0
    mixed = 0
    for step, rollouts in recording.taken.items():
        _check_trajectories(prompts, rollouts, 2, step)
        for logp, versions, mask in zip(rollouts.rollout_logp, rollouts.token_versions, rollouts.response_mask):
            policy = mask.bool()
            mixed += len(set(versions[policy].tolist())) > 1
            # Each policy token's behaviour log-prob is that of the weights that produced it.
            torch.testing.assert_close(logp[policy], ROLLOUT_LOGP - 0.1 * versions[policy].float(), rtol=0, atol=1e-6)
    assert mixed > 0, "no trajectory was continued with newer weights"


def test_one_step_off_takes_multi_turn_trajectories_one_version_behind(tmp_path, assets):
    config = _config(tmp_path, assets, "rollout.mode=one_step_off")
    prompts = build_prompt_side(config)
    engines = CalculatorEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])
    trainer = Trainer(config, prompts, FakeJob(), FakeActor(), engines)
    recording = RecordedTakes(trainer)
    assert trainer.fit() == 0
    for step, rollouts in recording.taken.items():
        _check_trajectories(prompts, rollouts)
        assert rollouts.weight_versions == [max(step - 2, 0)] * (PROMPTS * N)

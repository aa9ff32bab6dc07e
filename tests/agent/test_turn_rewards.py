"""An environment's per-turn rewards: recorded at the last policy token of the turn they answer, and placed there
as token rewards for the token-level estimators (the rest of the score stays at the last token)."""

from __future__ import annotations

import torch

from rlmega.agent.config import AgentConfig
from rlmega.agent.loop import AgentLoop, episode_info, turn_reward_tokens
from rlmega.config.schema import AlgorithmConfig
from rlmega.data import build_char_tokenizer
from rlmega.rollout.protocol import SamplingParams
from rlmega.trainer.advantages import compute_advantages

from .helpers import FakeTools, ScriptedGenerator, record

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


class Guess:
    def reset(self, example):
        self.target = example["ground_truth"]
        return "guess a digit"

    def step(self, messages):
        guess = messages[-1]["content"]
        if guess == self.target:
            return None, 1.0, True
        return ("higher" if guess < self.target else "lower"), -0.25, False


def test_each_step_reward_sits_at_the_last_token_of_its_turn():
    texts = ["3", "9", "7"]
    generator = ScriptedGenerator(
        lambda context, call: TOKENIZER.encode(texts[call], add_special_tokens=False) + [EOS], [EOS])
    config = AgentConfig(enabled=True, max_turns=4, max_response_tokens=1000)
    loop = AgentLoop(config, TOKENIZER, stop_token_ids=[EOS], tools=FakeTools({}), environment_factory=Guess)
    trajectory = loop.run(generator, [record("x", ground_truth="7")],
                          SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,)))[0]
    # Each turn is "<digit><eos>"; its last policy token is the EOS closing it.
    turn_ends = [position for position, token in enumerate(trajectory.response_token_ids)
                 if token == EOS and trajectory.loss_mask[position]]
    assert trajectory.turn_rewards == list(zip(turn_ends, [-0.25, -0.25, 1.0]))
    assert sum(reward for _, reward in trajectory.turn_rewards) == trajectory.env_reward == 0.5
    tokens = turn_reward_tokens(trajectory)
    assert [tokens[position] for position in turn_ends] == [-0.25, -0.25, 1.0]
    assert sum(tokens) == 0.5 and len(tokens) == len(trajectory.response_token_ids)
    assert episode_info(trajectory)["turn_rewards"] == trajectory.turn_rewards


# One trajectory of 5 tokens: a policy turn (2 tokens) that the environment rewards -0.25, 2 masked tokens, the
# answer, with an outcome of 1: its score (outcome + environment rewards) is 0.75.
MASK = [torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])]
TURN_REWARDS = [torch.tensor([0.0, -0.25, 0.0, 0.0, 0.0])]
SCORES = torch.tensor([0.75])


def test_token_level_estimators_see_the_turn_rewards_where_they_were_earned():
    config = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    _, returns, metrics = compute_advantages(config, SCORES, [5], [0], response_mask=MASK, turn_rewards=TURN_REWARDS)
    # Over the policy tokens, rewards (0, -0.25, 1) and gamma 0.5: G = (0.125, 0.25, 1).
    torch.testing.assert_close(returns[0], torch.tensor([0.125, 0.25, 0.0, 0.0, 1.0]), rtol=0, atol=1e-7)
    assert metrics["critic/rewards/mean"] == 0.75
    # Summed into the score instead, all of it at the last token: rewards (0, 0, 0.75), G = (0.1875, 0.375, 0.75).
    _, summed, _ = compute_advantages(config, SCORES, [5], [0], response_mask=MASK)
    torch.testing.assert_close(summed[0], torch.tensor([0.1875, 0.375, 0.0, 0.0, 0.75]), rtol=0, atol=1e-7)


def test_outcome_estimators_see_the_same_score():
    config = AlgorithmConfig(adv_estimator="grpo")
    scores = torch.tensor([0.75, 0.0])
    masks, rewards = MASK + [torch.ones(3)], TURN_REWARDS + [torch.zeros(3)]
    with_turns = compute_advantages(config, scores, [5, 3], [0, 0], response_mask=masks, turn_rewards=rewards)[0]
    without = compute_advantages(config, scores, [5, 3], [0, 0], response_mask=masks)[0]
    assert all(torch.equal(a, b) for a, b in zip(with_turns, without))


def test_a_turn_reward_on_a_dropped_token_joins_the_score_at_the_last_token():
    config = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    dropped = [torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])]  # the rewarded token is masked out
    _, returns, _ = compute_advantages(config, SCORES, [5], [0], response_mask=dropped, turn_rewards=TURN_REWARDS)
    torch.testing.assert_close(returns[0], torch.tensor([0.375, 0.0, 0.0, 0.0, 0.75]), rtol=0, atol=1e-7)

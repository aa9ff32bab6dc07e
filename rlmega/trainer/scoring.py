"""Scores of responses: the reward manager (rules, user function, reward model, judge, weighted per data
source), an agent's episode handed to the scorers and its environment's rewards added, and DAPO's overlong
shaping; and the metrics of everything a step generated.

    scorer = ScorerConfig(...).build(tokenizer, data_sources=..., reward_model=reward_model, judge=judge)
    scores, reward_metrics = scorer.score(records, generations)
    shaped = scorer.shape_scores(scores, generations)
    scored = scorer.score_responses(records, generations)      # with the other numbers each reward gave
    metric = dynamic_sampling_values("acc", scored, shaped, records, generations)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Optional, Sequence

import torch

from rlmega import algos
from rlmega.errors import UserError
from rlmega.rewards import RewardManager
from rlmega.rewards.judge import JudgeEngines
from rlmega.rewards.reward_model import SequenceScorer
from rlmega.rollout.protocol import Generation
from rlmega.trainer.metrics import batch_metrics
from rlmega.trainer.reward_manager import RewardManagerConfig, build_reward_manager


@dataclasses.dataclass
class ScorerConfig:
    rewards: RewardManagerConfig
    """The reward manager's sections."""
    agent_scored_text: Optional[str]
    """``agent.scored_text`` with the agent loop (``agent.enabled``), ``gateway.scored_text`` with the gateway
    (``gateway.enabled``), else None: plain responses."""
    overlong_buffer_length: int
    """``algorithm.overlong_buffer_length`` (DAPO; 0: no overlong shaping)."""
    overlong_penalty_factor: float
    """``algorithm.overlong_penalty_factor``."""
    max_response_length: int
    """The longest response: ``agent.max_response_tokens`` with the agent loop, else ``rollout.max_new_tokens``."""

    def build(self, tokenizer: Any, *, data_sources: Collection[str], val_data_sources: Optional[Collection[str]],
              reward_model: Optional[SequenceScorer] = None, judge: Optional[JudgeEngines] = None) -> Scorer:
        """``reward_model`` and ``judge`` (started by ``cluster.start_reward_workers``) belong to the scorer from
        here on: its reward manager scores with them and ``close`` shuts them down. Every data source of the
        training (and validation) prompts is checked to have a scorer."""
        rewards = build_reward_manager(self.rewards, tokenizer, reward_model=reward_model, judge=judge)
        rewards.check_data_sources(data_sources)
        if val_data_sources is not None:
            rewards.check_data_sources(val_data_sources, validation=True)
        return Scorer(self, tokenizer, rewards)


@dataclasses.dataclass
class ScoredResponses:
    """One call's scores: ``raw [N]`` (the reward manager's, before overlong shaping), the other numbers each
    response's reward gave beside its score (``extras``), whether its scoring failed, and the manager's metrics."""

    raw: torch.Tensor
    extras: list[dict[str, float]]
    failed: list[bool]
    metrics: dict[str, float]


class Scorer:
    """Scores responses to prompt records; thread-safe (the reward manager serialises calls)."""

    def __init__(self, config: ScorerConfig, tokenizer: Any, rewards: RewardManager):
        self.config = config
        self.tokenizer = tokenizer
        self.rewards = rewards
        """The reward manager: rules, user function, reward model and judge, weighted per data source."""

    def score(self, records: Sequence, generations: list[Generation], *,
              validation: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[len(generations)]`` of responses to ``records[g.prompt_index]``, and the reward manager's
        metrics. ``validation``: responses to validation prompts, scored with the validation weights
        (``reward.val_weights``)."""
        scored = self.score_responses(records, generations, validation=validation)
        return scored.raw, scored.metrics

    def score_responses(self, records: Sequence, generations: list[Generation], *,
                        validation: bool = False) -> ScoredResponses:
        """As ``score``, with each response's other reward numbers and whether its scoring failed."""
        from rlmega.rewards import ScoreItem

        texts = [self.tokenizer.decode(g.response_token_ids, skip_special_tokens=True) for g in generations]
        items = [ScoreItem.from_record(records[g.prompt_index], text, g.response_token_ids)
                 for g, text in zip(generations, texts)]
        if self.config.agent_scored_text is not None:  # the scorer also gets the episode: final answer, turns, tools
            from rlmega.agent.loop import episode_info

            for item, generation in zip(items, generations):
                episode = episode_info(generation)
                item.extra_info = {**(item.extra_info or {}), "agent": episode}
                item.prompt_token_ids = generation.prompt_token_ids  # rendered with the tools
                if self.config.agent_scored_text == "final_answer":
                    item.solution_str = episode["final_answer"]
        scored, metrics = self.rewards.score_each(items, validation=validation)
        # An agent's environment rewards its episode too (0 without one).
        scores = [item.score + getattr(g, "env_reward", 0.0) for item, g in zip(scored, generations)]
        return ScoredResponses(torch.tensor(scores, dtype=torch.float32), [item.extras for item in scored],
                               [item.failed for item in scored], metrics)

    def shape_scores(self, scores: torch.Tensor, generations: list[Generation]) -> torch.Tensor:
        """Scores after DAPO's overlong shaping (when configured)."""
        config = self.config
        if not config.overlong_buffer_length:
            return scores.clone()
        lengths = torch.tensor([len(g.response_token_ids) for g in generations])
        return scores + algos.overlong_reward_penalty(
            lengths, max_response_length=config.max_response_length,
            overlong_buffer_length=config.overlong_buffer_length, penalty_factor=config.overlong_penalty_factor)

    def close(self) -> None:
        """End the scoring processes, and the reward model's ranks and the judge's engines if any."""
        self.rewards.close()


def generation_metrics(scores: torch.Tensor, generations: list[Generation],
                       reward_metrics: dict[str, float]) -> dict[str, float]:
    """Scores and lengths of everything generated for a step (kept or not), and the scorer's metrics."""
    metrics = batch_metrics(scores, [len(g.response_token_ids) for g in generations],
                            truncated=[g.finish_reason == "length" for g in generations])
    metrics.update({name if "/" in name else f"reward/{name}": value for name, value in reward_metrics.items()})
    if generations and hasattr(generations[0], "loss_mask"):  # an agent's trajectories
        from rlmega.agent.loop import agent_metrics

        metrics.update(agent_metrics(generations))
    if generations and hasattr(generations[0], "lost"):  # made by a harness through the gateway
        from rlmega.gateway.harness import gateway_metrics

        metrics.update(gateway_metrics(generations))
    return metrics


SHAPED_SCORE, SCORE, ACCURACY = "shaped_score", "score", "acc"


def dynamic_sampling_values(metric: str, scored: ScoredResponses, shaped: torch.Tensor, records: Sequence,
                            generations: list[Generation]) -> torch.Tensor:
    """``[N]`` the values ``algorithm.dynamic_sampling_metric`` compares within each group: the shaped scores,
    the raw ones, or a number each reward gave beside its score (``acc`` of a plain-number reward is that number,
    as verl's DAPO reward manager records it; a response whose scoring failed counts 0). UserError when a
    response's reward lacks the named number."""
    if metric == SHAPED_SCORE:
        return shaped
    if metric == SCORE:
        return scored.raw
    values = []
    for index, (extras, failed) in enumerate(zip(scored.extras, scored.failed)):
        if metric in extras:
            values.append(extras[metric])
        elif metric == ACCURACY and not extras:
            values.append(float(scored.raw[index]))
        elif failed:
            values.append(0.0)
        else:
            source = records[generations[index].prompt_index].data_source
            given = ", ".join(sorted(extras)) or "only its score"
            raise UserError(f"algorithm.dynamic_sampling_metric={metric}: the reward of a response to a "
                            f"{source!r} prompt gave no {metric!r} (it gave {given}); name one of those, or "
                            f"{SHAPED_SCORE} or {SCORE}")
    return torch.tensor(values, dtype=torch.float32)

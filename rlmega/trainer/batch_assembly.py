"""The trainer's batch from scored groups: one step's trajectories (``Rollouts``), grouped by prompt, with the
token ids as the engine saw them, its per-token log-probs, the weight version of every token, the loss mask
and, where they apply, ReMax's baseline scores, an agent's turn rewards and the engines' routing (R3).

    rollouts = BatchAssembler(AssemblyConfig(...)).assemble(groups, metrics)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlmega.data.schema import PromptRecord
from rlmega.rollout.protocol import Generation
from rlmega.workers.batching import SequenceBatch


@dataclasses.dataclass
class Rollouts:
    """One step's trajectories, grouped by prompt (the n responses of a prompt are consecutive)."""

    batch: SequenceBatch
    """prompt + response token ids exactly as the engine saw and produced them, at the sampling temperature."""
    scores: torch.Tensor
    """``[B]`` scores after reward shaping."""
    group_ids: list[int]
    rollout_logp: list[torch.Tensor]
    """``[R_i]`` the engine's log-prob of every response token, under the sampled distribution."""
    weight_versions: list[int]
    """The oldest weight version among each response's tokens."""
    token_versions: list[torch.Tensor]
    """``[R_i]`` the weight version that produced every response token (one value per response unless an
    asynchronous run continued it with newer weights)."""
    prompt_indices: list[int]
    """The dataset index of every group's prompt."""
    response_mask: Optional[list[torch.Tensor]]
    """Per-token loss mask when overlong filtering zeroes some responses; None when all tokens count."""
    baseline_scores: Optional[torch.Tensor]
    """``[B]`` the score of the greedy response to the same prompt (ReMax), else None."""
    metrics: dict[str, float]
    turn_rewards: Optional[list[torch.Tensor]] = None
    """``[R_i]`` an agent environment's per-turn rewards at their turns' last policy tokens (parts of
    ``scores``, placed there by the advantage estimators); None without turn rewards."""


@dataclasses.dataclass
class Group:
    """The n scored responses to one prompt."""

    record: PromptRecord
    generations: list[Generation]
    scores: torch.Tensor
    """``[n]`` after reward shaping."""
    baseline: float = 0.0
    """ReMax: the greedy response's score."""
    token_versions: Optional[list[torch.Tensor]] = None
    """Per response, the weight version of every token, when it is not one version per response."""


@dataclasses.dataclass
class AssemblyConfig:
    temperature: float
    """``rollout.temperature``: the distribution the responses were sampled from (the trainer's log-probs use it)."""
    filter_truncated: bool
    """``algorithm.filter_truncated``: a response the token limit cut is masked out of the loss."""
    multi_turn: bool
    """``agent.enabled``: responses are the agent loop's trajectories, with their own loss mask."""
    greedy_baseline: bool
    """ReMax (``algorithm.adv_estimator: remax``): the batch carries the greedy responses' scores."""

    def build(self) -> BatchAssembler:
        return BatchAssembler(self)


class BatchAssembler:
    def __init__(self, config: AssemblyConfig):
        self.config = config

    def assemble(self, kept: list[Group], metrics: dict[str, float]) -> Rollouts:
        """The trainer's batch from whole groups, in order."""
        config = self.config
        tokens, prompts, scores, group_ids, masks, logps, versions, token_versions, baselines = ([] for _ in range(9))
        for group_index, group in enumerate(kept):
            for sample, (generation, score) in enumerate(zip(group.generations, group.scores)):
                # An agent's trajectory starts from its own prompt (rendered with the tools).
                prompt = getattr(generation, "prompt_token_ids", group.record.prompt_token_ids)
                tokens.append(torch.tensor(prompt + generation.response_token_ids))
                prompts.append(len(prompt))
                scores.append(float(score))
                group_ids.append(group_index)
                logps.append(torch.tensor(generation.logprobs, dtype=torch.float32))
                length = len(generation.response_token_ids)
                produced_by = (torch.full((length,), generation.weight_version, dtype=torch.long)
                               if group.token_versions is None else group.token_versions[sample])
                token_versions.append(produced_by)
                versions.append(int(produced_by.min()) if length else generation.weight_version)
                baselines.append(group.baseline)
                truncated = config.filter_truncated and generation.finish_reason == "length"
                own_tokens = getattr(generation, "loss_mask", None)  # an agent's: 0 on tool output and glue
                mask = torch.ones(length) if own_tokens is None else torch.tensor(own_tokens, dtype=torch.float32)
                masks.append(mask * (0.0 if truncated else 1.0))
        metrics["batch/num_sequences"] = float(len(tokens))
        # R3: the engines' routing of every token, replayed by the actor (None unless every engine recorded it).
        routing = [generation.routing for group in kept for generation in group.generations]
        routing = routing if routing and all(r is not None and r.shape[0] == t.numel()
                                             for r, t in zip(routing, tokens)) else None
        turn_rewards = None
        if config.multi_turn and any(getattr(g, "turn_rewards", None) for group in kept for g in group.generations):
            from rlmega.agent.loop import turn_reward_tokens

            turn_rewards = [torch.tensor(turn_reward_tokens(g), dtype=torch.float32)
                            for group in kept for g in group.generations]
        images = [group.record.images for group in kept for _ in group.generations]
        return Rollouts(
            batch=SequenceBatch(tokens, prompts, temperature=config.temperature, routing=routing,
                                images=images if any(item is not None for item in images) else None),
            scores=torch.tensor(scores), group_ids=group_ids, rollout_logp=logps, weight_versions=versions,
            token_versions=token_versions, prompt_indices=[group.record.index for group in kept],
            response_mask=masks if config.filter_truncated or config.multi_turn else None,
            baseline_scores=torch.tensor(baselines) if config.greedy_baseline else None, metrics=metrics,
            turn_rewards=turn_rewards,
        )

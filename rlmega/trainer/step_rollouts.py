"""One step's scored trajectories from the prompt side's parts: n responses to each of the step's prompts,
generated and scored in rounds until the step has ``prompts_per_step`` usable groups (DAPO's dynamic sampling
drops groups whose metric is equal over the group and draws more prompts), with ReMax's greedy baseline beside them."""

from __future__ import annotations

import dataclasses

import torch

from rlmega import algos
from rlmega.trainer.batch_assembly import BatchAssembler, Group, Rollouts
from rlmega.trainer.generation import Generator, ResponseGenerator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.scoring import Scorer, dynamic_sampling_values, generation_metrics


@dataclasses.dataclass
class StepRolloutsConfig:
    prompts_per_step: int
    """``trainer.prompts_per_step``: the groups a step trains on."""
    dynamic_sampling: bool
    """``algorithm.dynamic_sampling``: drop groups whose metric is equal over the group, generate more."""
    dynamic_sampling_metric: str
    """``algorithm.dynamic_sampling_metric``: what is compared (``scoring.dynamic_sampling_values``)."""
    max_generation_rounds: int
    """``algorithm.max_generation_rounds``: the most rounds of prompts a step draws with dynamic sampling."""
    greedy_baseline: bool
    """ReMax (``algorithm.adv_estimator: remax``): score a greedy response to every prompt as its baseline."""


class StepRollouts:
    """A synchronous step's rollouts: prompts from ``data``, responses from ``generator``, scores from ``scorer``,
    the batch from ``assembler``."""

    def __init__(self, config: StepRolloutsConfig, data: PromptData, generator: ResponseGenerator, scorer: Scorer,
                 assembler: BatchAssembler):
        self.config = config
        self.data, self.generator, self.scorer, self.assembler = data, generator, scorer, assembler

    def take(self, engines: Generator, step: int) -> Rollouts:
        """Generate and score responses until the step has ``prompts_per_step`` usable groups (DAPO's
        dynamic sampling may take several rounds), or the round limit is reached."""
        config, generator, scorer = self.config, self.generator, self.scorer
        wanted = config.prompts_per_step
        kept: list[Group] = []
        rounds = config.max_generation_rounds if config.dynamic_sampling else 1
        all_scores, all_generations, reward_metrics, dropped = [], [], {}, 0
        for round_index in range(rounds):
            records = self.data.next_records()
            generations = generator.generate(engines, records, generator.step_params(step, round_index))
            scored = scorer.score_responses(records, generations)
            raw_scores, reward_metrics = scored.raw, scored.metrics
            all_scores.append(raw_scores)
            all_generations.extend(generations)
            scores = scorer.shape_scores(raw_scores, generations)
            baselines = torch.zeros(len(records))
            if config.greedy_baseline:
                greedy = generator.generate(engines, records, generator.greedy_params())
                baselines = scorer.score(records, greedy)[0]
            group_ids = [g.prompt_index for g in generations]
            keep = range(len(records))
            if config.dynamic_sampling:
                metric = dynamic_sampling_values(config.dynamic_sampling_metric, scored, scores, records, generations)
                result = algos.dynamic_sampling_filter(torch.tensor(group_ids), metric)
                keep = sorted({group_ids[i] for i in result.kept_indices.tolist()})
                dropped += result.num_dropped_groups
            for prompt_index in keep:
                members = [i for i, g in enumerate(group_ids) if g == prompt_index]
                kept.append(Group(records[prompt_index], [generations[i] for i in members], scores[members],
                                  float(baselines[prompt_index])))
            if len(kept) >= wanted:
                break
        kept = kept[:wanted]
        if not kept:
            raise RuntimeError(
                f"step {step}: every prompt group had an equal {config.dynamic_sampling_metric} in {rounds} generation "
                "rounds, nothing to train on; "
                "raise algorithm.max_generation_rounds or rollout.n, or turn off algorithm.dynamic_sampling"
            )
        metrics = generation_metrics(torch.cat(all_scores), all_generations, reward_metrics)
        metrics.update({"batch/generation_rounds": float(round_index + 1), "batch/dropped_groups": float(dropped)})
        return self.assembler.assemble(kept, metrics)

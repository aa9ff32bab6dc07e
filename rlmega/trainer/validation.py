"""Validation: the policy's answers to the first validation prompts, scored with the validation weights, and a
few of them (prompt, response, ground truth, score) to show."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlmega.trainer.generation import Generator, ResponseGenerator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.scoring import Scorer


@dataclasses.dataclass
class ValidationConfig:
    num_prompts: int
    """``trainer.val_prompts``: the first this many validation prompts are answered."""
    temperature: float
    """``rollout.val_temperature`` (0: greedy)."""
    top_p: float
    """``rollout.val_top_p``, or ``rollout.top_p`` when that is None."""
    top_k: Optional[int]
    """``rollout.val_top_k`` (0: None, no top-k), or ``rollout.top_k`` when that is None."""
    num_responses: int
    """``rollout.val_n``: responses per prompt."""
    seed: int
    """``trainer.seed``: the same sampled answers at every validation of the same weights."""
    num_samples_shown: int
    """``trainer.log_val_generations``: samples returned to show."""


class Validation:
    def __init__(self, config: ValidationConfig, data: PromptData, generator: ResponseGenerator, scorer: Scorer):
        self.config = config
        self.data, self.generator, self.scorer = data, generator, scorer

    def run(self, engines: Generator) -> tuple[dict[str, float], list[dict]]:
        """``rollout.val_n`` answers to each of the first ``trainer.val_prompts`` validation prompts, sampled with
        the validation's parameters, scored: the metrics, and the first ``trainer.log_val_generations`` samples
        (prompt, response, ground truth, score) to show."""
        config, tokenizer, val_dataset = self.config, self.data.tokenizer, self.data.val_dataset
        count = min(config.num_prompts, len(val_dataset))
        records = val_dataset.batch(list(range(count)))
        params = self.generator.filtered_params(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                                n=config.num_responses, seed=config.seed)
        generations = self.generator.generate(engines, records, params)
        scores, _ = self.scorer.score(records, generations, validation=True)
        samples = [
            {"prompt": tokenizer.decode(records[g.prompt_index].prompt_token_ids, skip_special_tokens=True),
             "response": tokenizer.decode(g.response_token_ids, skip_special_tokens=True),
             "ground_truth": str(records[g.prompt_index].ground_truth), "score": float(score)}
            for g, score in list(zip(generations, scores))[:config.num_samples_shown]
        ]
        correct = scores >= 1.0
        metrics = {"val/score/mean": float(scores.mean()), "val/accuracy": float(correct.float().mean())}
        if config.num_responses > 1:
            prompt_indices = torch.tensor([g.prompt_index for g in generations])
            solved = torch.zeros(count).scatter_reduce(0, prompt_indices, correct.float(), reduce="amax")
            metrics[f"val/pass@{config.num_responses}"] = float(solved.mean())
        return metrics, samples

"""Validation: the policy's answers to the first validation prompts, scored with the validation weights, and a
few of them (prompt, response, ground truth, score) to show."""

from __future__ import annotations

import dataclasses

from rlmega.trainer.generation import Generator, ResponseGenerator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.scoring import Scorer


@dataclasses.dataclass
class ValidationConfig:
    num_prompts: int
    """``trainer.val_prompts``: the first this many validation prompts are answered."""
    temperature: float
    """``rollout.val_temperature``."""
    seed: int
    """``trainer.seed``: the same sampled answers at every validation of the same weights."""
    num_samples_shown: int
    """``trainer.log_val_generations``: samples returned to show."""


class Validation:
    def __init__(self, config: ValidationConfig, data: PromptData, generator: ResponseGenerator, scorer: Scorer):
        self.config = config
        self.data, self.generator, self.scorer = data, generator, scorer

    def run(self, engines: Generator) -> tuple[dict[str, float], list[dict]]:
        """Answers to the first ``trainer.val_prompts`` validation prompts at ``rollout.val_temperature``,
        scored: the metrics, and the first ``trainer.log_val_generations`` samples (prompt, response,
        ground truth, score) to show."""
        config, tokenizer, val_dataset = self.config, self.data.tokenizer, self.data.val_dataset
        count = min(config.num_prompts, len(val_dataset))
        records = val_dataset.batch(list(range(count)))
        params = self.generator.sampling_params(temperature=config.temperature, n=1, seed=config.seed)
        generations = self.generator.generate(engines, records, params)
        scores, _ = self.scorer.score(records, generations, validation=True)
        samples = [
            {"prompt": tokenizer.decode(records[g.prompt_index].prompt_token_ids, skip_special_tokens=True),
             "response": tokenizer.decode(g.response_token_ids, skip_special_tokens=True),
             "ground_truth": str(records[g.prompt_index].ground_truth), "score": float(score)}
            for g, score in list(zip(generations, scores))[:config.num_samples_shown]
        ]
        metrics = {"val/score/mean": float(scores.mean()), "val/accuracy": float((scores >= 1.0).float().mean())}
        return metrics, samples

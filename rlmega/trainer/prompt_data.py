"""A run's prompts: the tokenizer (and a vision-language model's processor), the training and validation
datasets, the resumable sampler that draws each step's prompts, and the run's length in steps.

    data = PromptDataConfig(...).build(datasets)     # datasets: as the start-up checks read them, or None
    records = data.next_records()                    # one step's prompts, in the sampler's order
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from rlmega.data import DataConfig, PromptDatasets, StatefulSampler
from rlmega.data.schema import PromptRecord


@dataclasses.dataclass
class PromptDataConfig:
    model_path: str
    """``model.path``: the tokenizer's checkpoint (unless ``tokenizer_path``), and a vision-language model's."""
    tokenizer_path: Optional[str]
    """``model.tokenizer_path``."""
    data: DataConfig
    """``data``: the training prompts."""
    val_data: Optional[DataConfig]
    """``val_data``; None without validation (``trainer.val_every: 0``)."""
    prompts_per_step: int
    """``trainer.prompts_per_step``: the sampler's batch."""
    seed: int
    """``trainer.seed``: the sampler's order."""
    total_steps: int
    """``trainer.total_steps``, the run's length unless ``total_epochs`` is set."""
    total_epochs: Optional[int]
    """``trainer.total_epochs``: passes over the training prompts."""
    multi_turn: bool
    """``agent.enabled``: every response comes from the agent loop (which takes no images yet)."""

    def build(self, datasets: Optional[PromptDatasets] = None) -> PromptData:
        """``datasets``: the prompts as the start-up checks read them (``rlmega.config.validate``); None reads them
        here."""
        from transformers import AutoTokenizer

        from rlmega.data.images import image_prompts_for

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path or self.model_path)
        processor = image_prompts_for(self.model_path, self.tokenizer_path, tokenizer, multi_turn=self.multi_turn)
        if datasets is None:
            datasets = PromptDatasets.read(self.data, self.val_data, tokenizer, processor)
        return PromptData(self, tokenizer, processor, datasets)


class PromptData:
    """The tokenizer, the datasets and the sampler; the sampler's position is the checkpointed state."""

    def __init__(self, config: PromptDataConfig, tokenizer: Any, processor: Any, datasets: PromptDatasets):
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        """A vision-language model's processor (its images' pixels and pad tokens); None for text models."""
        self.dataset, self.val_dataset = datasets.train, datasets.val
        self.sampler = StatefulSampler(len(self.dataset), config.prompts_per_step, seed=config.seed)
        epochs = config.total_epochs
        self.total_steps = epochs * self.sampler.steps_per_epoch if epochs else config.total_steps
        """The run's RL steps: ``trainer.total_epochs`` passes over the prompts, or ``trainer.total_steps``."""

    def next_records(self) -> list[PromptRecord]:
        """The next ``prompts_per_step`` training prompts the sampler draws."""
        return self.dataset.batch(self.sampler.next_batch())

    def probes(self) -> list[list[int]]:
        """Prompts the post-sync check generates from: text only (a vision-language prompt without its image
        markup), so the check compares the language model's weights; the vision tower is not probed."""
        prompts = [record.prompt_token_ids for record in self.dataset.batch([0, 1])]
        if self.processor is None:
            return prompts
        markup = set(self.tokenizer.encode(self.processor.markup, add_special_tokens=False))
        return [[token for token in prompt if token not in markup] for prompt in prompts]

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

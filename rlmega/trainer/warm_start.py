"""The supervised warm-start (``trainer.sft_steps``): the training prompts with their ground-truth answers, or
with demonstrated turns (``agent.demonstration`` run through the agent loop, ``gateway.demonstration`` through the
agent harness and the gateway), trained on before RL (a tiny model's start)."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence

import torch

from rlmega.data import StatefulSampler
from rlmega.data.schema import PromptRecord
from rlmega.errors import UserError
from rlmega.trainer.generation import ResponseGenerator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.roles import Actor
from rlmega.workers.batching import SequenceBatch


@dataclasses.dataclass
class WarmStartConfig:
    num_steps: int
    """``trainer.sft_steps``."""
    lr: float
    """``trainer.sft_lr``: the actor optimizer's learning rate in these steps."""
    sequences_per_step: int
    """As many as an RL step trains on: ``trainer.prompts_per_step x rollout.n``."""
    seed: int
    """``trainer.seed``; the warm-start's sampler draws its own order from it."""
    demonstration: Optional[str]
    """``agent.demonstration`` with the agent loop (``agent.enabled``), ``gateway.demonstration`` with the gateway
    (``gateway.enabled``), else None: answers are the ground truths."""
    demonstration_setting: str = "agent.demonstration"
    """The setting that names ``demonstration`` (for errors)."""


class WarmStart:
    def __init__(self, config: WarmStartConfig, data: PromptData, generator: ResponseGenerator):
        self.config, self.data, self.generator = config, data, generator

    def batches(self) -> Iterator[SequenceBatch]:
        """``trainer.sft_steps`` batches of training prompts with their ground-truth answers, as many sequences
        each as an RL step trains on."""
        config, dataset, tokenizer = self.config, self.data.dataset, self.data.tokenizer
        per_step = min(config.sequences_per_step, len(dataset))
        sampler = StatefulSampler(len(dataset), per_step, seed=config.seed + 1)
        demonstration = None
        if config.demonstration is not None:
            from rlmega.agent.functions import load_callable

            demonstration = load_callable(config.demonstration)
        for _ in range(config.num_steps):
            records = dataset.batch(sampler.next_batch())
            if demonstration is not None:
                yield self._demonstrated(records, demonstration)
                continue
            tokens, prompts = [], []
            for record in records:
                answer = tokenizer.encode(str(record.ground_truth), add_special_tokens=False)
                tokens.append(torch.tensor(record.prompt_token_ids + answer + list(self.generator.stop_token_ids)))
                prompts.append(len(record.prompt_token_ids))
            images = [record.images for record in records]
            yield SequenceBatch(tokens, prompts, images=images if any(item is not None for item in images) else None)

    def _demonstrated(self, records: Sequence[PromptRecord], demonstration) -> SequenceBatch:
        """The agent loop's (or the harness's) trajectories with the demonstrated turns, masked to train on those
        turns only."""
        from rlmega.agent.loop import example_of

        turns = []
        for record in records:
            texts = demonstration(example_of(record))
            if not isinstance(texts, (list, tuple)) or not all(isinstance(text, str) for text in texts):
                raise UserError(f"{self.config.demonstration_setting} {self.config.demonstration}: returned "
                                f"{texts!r} for row {record.index}; it must return a list of assistant turn texts")
            turns.append(texts)
        trajectories = self.generator.agent.demonstrate(records, turns)
        return SequenceBatch([torch.tensor(t.prompt_token_ids + t.response_token_ids) for t in trajectories],
                             [len(t.prompt_token_ids) for t in trajectories],
                             fields={"response_mask": [torch.tensor(t.loss_mask, dtype=torch.float32)
                                                       for t in trajectories]})


def supervised_warm_start(actor: Actor, warm_start: WarmStart) -> None:
    """``trainer.sft_steps`` supervised steps on the training prompts' ground-truth answers (a tiny model's start)."""
    total = warm_start.config.num_steps
    for step, batch in enumerate(warm_start.batches(), start=1):
        metrics = actor.sft_step(batch, warm_start.config.lr)
        if step == 1 or step % 10 == 0 or step == total:
            print(f"warm-start {step}/{total}: sft_loss {metrics['sft_loss']:.4f}", flush=True)

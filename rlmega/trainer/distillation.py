"""On-policy distillation's part of an RL step (``algorithm.distill``): the teacher scores the student's responses
once per step, before the update, and its signal joins the advantages (``k1``, ``k3``) or the actor's loss
(``top_k``). The math is ``rlmega.algos.distill``'s.

    advantages, batch, metrics = distillation.apply(batch, data_sources, old_logp, advantages, response_mask)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlmega.algos.distill import DistillConfig, apply_distill_advantage, teacher_kl_metrics
from rlmega.trainer.roles import Teachers
from rlmega.workers.batching import SequenceBatch, padded_field, padding_mask


class Distillation:
    """The teacher's scores of a step's responses, applied as ``algorithm.distill`` says."""

    def __init__(self, config: DistillConfig, teachers: Optional[Teachers]):
        if teachers is None:
            raise ValueError("algorithm.distill.coef > 0 needs the teachers (teacher.enable=true starts them)")
        self.config, self.teachers = config, teachers

    def apply(self, batch: SequenceBatch, data_sources: list[str], old_logp: list[torch.Tensor],
              advantages: list[torch.Tensor], response_mask: Optional[list[torch.Tensor]],
              ) -> tuple[list[torch.Tensor], SequenceBatch, dict[str, float]]:
        """The advantages and the batch the actor trains on, and the metrics ``distill/...``.

        ``old_logp``: per sequence ``[R_i]``, the student's log-probs of its tokens (the policy that sampled them);
        ``response_mask``: the rollouts' loss mask (None: every response token), over which the metrics average.
        ``k1`` / ``k3``: the advantages become ``reward_weight * A - coef * KL`` per token. ``top_k``: they are
        ``reward_weight * A``, and the batch carries the teacher's top-k and the term for the actor's loss.
        """
        config = self.config
        lengths = batch.response_lengths
        teacher_logp, _ = self.teachers.compute_logprobs(batch, data_sources)
        logp, teacher, padded_advantages = (padded_field(values, lengths=lengths)[0]
                                            for values in (old_logp, teacher_logp, advantages))
        mask = padding_mask(lengths)
        if response_mask is not None:
            mask &= padded_field(response_mask, lengths=lengths)[0].ne(0)
        metrics = {f"distill/{name}": float(value) for name, value in teacher_kl_metrics(logp, teacher, mask).items()}
        if config.estimator == "top_k":
            ids, top_logp = self.teachers.compute_top_k(batch, config.top_k, data_sources)
            batch = dataclasses.replace(batch.with_fields(teacher_topk_ids=ids, teacher_topk_logp=top_logp),
                                        distill=config)
            mixed = config.reward_weight * torch.where(mask, padded_advantages, 0.0)
        else:
            mixed = apply_distill_advantage(padded_advantages, logp, teacher, mask, coef=config.coef,
                                            estimator=config.estimator, reward_weight=config.reward_weight)
        return [row[:n].clone() for row, n in zip(mixed, lengths)], batch, metrics

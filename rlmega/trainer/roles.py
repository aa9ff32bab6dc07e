"""The controller's typed view of the workers: one group per role, each with real methods.

``ActorGroup``, ``ReferenceGroup``, ``CriticGroup``, ``RewardModelGroup`` and ``TeacherGroup`` call the training
ranks' methods (``RankProcess``), which call the rank's ``MegatronWorker``: a value can be followed
from the loop into the worker. The Protocols say what the controller needs of each, so a loop
test can drive the ``Trainer`` with fakes, without Ray or processes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Protocol, Sequence

import torch

from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.sync import SyncStats
from rlmega.trainer.engine_restarts import EngineRestarts
from rlmega.trainer.training_group import RankCalls, RankProcess
from rlmega.workers.batching import SequenceBatch

LogProbs = tuple[list[torch.Tensor], list[torch.Tensor]]  # per sequence: log-probs [R_i], entropies [R_i]
TopK = tuple[list[torch.Tensor], list[torch.Tensor]]  # per sequence: ids [R_i, k] int64, log-probs [R_i, k] fp32


class Engines(Protocol):
    """The rollout engines (``rlmega.trainer.rollout_group.RolloutGroup``)."""

    restarts: Optional[EngineRestarts]
    """``rollout.restart_dead_engines`` (engines in processes of their own); None: a dead engine stops the run."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...
    def handles(self) -> list:
        """The engines the weight sync feeds, as the training ranks reach them."""
    def version(self) -> Optional[int]:
        """The weight version the engines serve: their own record, the one the run trusts (None: none serves yet)."""
    def sleep(self, level: int = 1) -> None: ...
    def wake(self) -> None: ...
    def shutdown(self) -> None: ...


class TrainingJob(Protocol):
    """What concerns every role on the training ranks at once (``TrainingRanks``)."""

    def set_offloaded(self, offloaded: bool) -> None: ...
    def release_training_state(self) -> None:
        """Gradient buffers freed, optimizer state to host, until the next update (before a colocated sync)."""
    def save(self, root: str, extra: dict, keep: Optional[int] = None) -> dict: ...
    def load(self, root: str, step: int) -> dict: ...
    def shutdown(self) -> None: ...


class Actor(Protocol):
    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs: ...
    def update(self, batch: SequenceBatch) -> dict[str, float]: ...
    def update_on_policy(self, batch: SequenceBatch) -> tuple[dict[str, float], list[torch.Tensor],
                                                                list[torch.Tensor]]: ...
    def sft_step(self, batch: SequenceBatch, lr: float) -> dict[str, float]: ...
    def connect(self, engines: list) -> None: ...
    def push_weights(self, version: int) -> SyncStats: ...
    def check_weights(self, probes: list[list[int]], version: int) -> float: ...
    def serve_replacement(self, engine, probes: Optional[list[list[int]]]) -> Optional[float]: ...


class Reference(Protocol):
    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs: ...
    def copy_from_actor(self) -> None: ...


class Critic(Protocol):
    def compute_values(self, batch: SequenceBatch) -> list[torch.Tensor]: ...
    def update(self, batch: SequenceBatch) -> dict[str, float]: ...


class RewardModel(Protocol):
    """What the reward manager needs of a reward model (``rlmega.rewards.reward_model.SequenceScorer``)."""

    def score(self, batch: SequenceBatch) -> torch.Tensor: ...
    def shutdown(self) -> None: ...


class Teacher(Protocol):
    """One frozen teacher model (``TeacherGroup``), as ``Teachers`` routes sequences to it."""

    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs: ...
    def compute_top_k(self, batch: SequenceBatch, k: int) -> TopK: ...
    def shutdown(self) -> None: ...


class ActorGroup:
    """The policy on the training ranks."""

    def __init__(self, ranks: RankCalls):
        self._ranks = ranks

    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs:
        return self._ranks.first(RankProcess.compute_logprobs, "actor", batch, what="actor log-probs")

    def update(self, batch: SequenceBatch) -> dict[str, float]:
        return self._ranks.first(RankProcess.update, "actor", batch, what="actor update")

    def update_on_policy(self, batch: SequenceBatch) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
        """The one optimizer step of a batch, with the old log-probs from its own forward pass (see
        ``MegatronWorker.update_on_policy``): the metrics, the log-probs and the entropies."""
        return self._ranks.first(RankProcess.update_on_policy, batch, what="actor update")

    def sft_step(self, batch: SequenceBatch, lr: float) -> dict[str, float]:
        return self._ranks.first(RankProcess.sft_step, batch, lr, what="supervised step")

    def export_lora(self, merged_dir: Path, adapter_dir: Path, base_model: str) -> Optional[str]:
        """A LoRA actor's merged weights as an HF checkpoint and its adapters as a PEFT adapter directory; a note on
        what was not written, if anything."""
        return self._ranks.first(RankProcess.export_lora, str(merged_dir), str(adapter_dir), base_model,
                                 what="LoRA export")

    def connect(self, engines: list) -> None:
        """The ranks' weight sync into ``engines`` (``Engines.handles``), its transport chosen once."""
        self._ranks.each(RankProcess.connect_engines, engines, what="weight sync set-up")

    def push_weights(self, version: int) -> SyncStats:
        """The trained weights into the connected engines as ``version``."""
        return self._ranks.first(RankProcess.push_weights, version, what="weight sync")

    def check_weights(self, probes: list[list[int]], version: int) -> float:
        """The post-sync check of the connected engines: the largest log-prob difference."""
        return self._ranks.first(RankProcess.check_weights, probes, version, what="post-sync check")

    def serve_replacement(self, engine, probes: Optional[list[list[int]]]) -> Optional[float]:
        """The weights of the last push into one engine restarted in place, checked on ``probes`` if given."""
        return self._ranks.first(RankProcess.serve_replacement, engine, probes, what="weight sync")


class ReferenceGroup:
    """The frozen reference policy (for KL terms) on the training ranks."""

    def __init__(self, ranks: RankCalls):
        self._ranks = ranks

    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs:
        return self._ranks.first(RankProcess.compute_logprobs, "ref", batch, what="reference log-probs")

    def copy_from_actor(self) -> None:
        self._ranks.each(RankProcess.reference_from_actor, what="reference from actor")


class CriticGroup:
    """The value model (PPO with GAE) on the training ranks."""

    def __init__(self, ranks: RankCalls):
        self._ranks = ranks

    def compute_values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        return self._ranks.first(RankProcess.compute_values, batch, what="critic values")

    def update(self, batch: SequenceBatch) -> dict[str, float]:
        return self._ranks.first(RankProcess.update, "critic", batch, what="critic update")


class RewardModelGroup:
    """A discriminative reward model (an HF ``*ForSequenceClassification`` checkpoint) on ranks of its own
    (``TrainingRanks.for_frozen_model``). Safe to call from several threads: calls are serialised, so
    every rank receives the collective calls in the same order."""

    def __init__(self, ranks: RankCalls):
        self._ranks = ranks
        self._lock = threading.Lock()

    def score(self, batch: SequenceBatch) -> torch.Tensor:
        """``[B]`` fp32, one score per whole sequence (see ``MegatronWorker.compute_scores``)."""
        with self._lock:
            return self._ranks.first(RankProcess.compute_scores, batch, what="reward-model scores")

    def shutdown(self) -> None:
        self._ranks.shutdown()


class TeacherGroup:
    """On-policy distillation's frozen teacher (an HF causal LM with the student's vocabulary) on ranks of its own
    (``TrainingRanks.for_frozen_model``). Safe to call from several threads: calls are serialised, so every rank
    receives the collective calls in the same order."""

    def __init__(self, ranks: RankCalls):
        self._ranks = ranks
        self._lock = threading.Lock()

    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs:
        """Per sequence, the teacher's log-probs and entropies ``[R_i]`` of the response tokens (under the batch's
        temperature, as every role's)."""
        with self._lock:
            return self._ranks.first(RankProcess.compute_logprobs, "teacher", batch, what="teacher log-probs")

    def compute_top_k(self, batch: SequenceBatch, k: int) -> TopK:
        """Per sequence, the teacher's ``k`` most likely tokens at each response position: ids ``[R_i, k]``
        (int64) and log-probs ``[R_i, k]`` (fp32), most likely first (``MegatronWorker.compute_top_k``)."""
        with self._lock:
            return self._ranks.first(RankProcess.compute_top_k, batch, k, what="teacher top-k")

    def shutdown(self) -> None:
        self._ranks.shutdown()


class Teachers:
    """The run's teachers: the main one, and one per data source of ``teacher.per_data_source`` (several teachers,
    as NeMo-RL's multi-teacher on-policy distillation). Each sequence goes to the teacher of its example's
    ``data_source`` (the main one where that source has none); the results come back in batch order:

        logprobs, entropies = teachers.compute_logprobs(batch, data_sources)   # [R_i] each
        ids, top_logprobs = teachers.compute_top_k(batch, k, data_sources)      # [R_i, k] each

    ``data_sources[i]`` is sequence ``i``'s data source (``len(data_sources) == len(batch)``). The teachers are
    on ranks of their own, so the calls to different teachers run at the same time. ``shutdown`` stops them all
    (the trainer does, with the run)."""

    def __init__(self, main: Teacher, per_data_source: Optional[dict[str, Teacher]] = None):
        self.main = main
        self.per_data_source = dict(per_data_source or {})

    def compute_logprobs(self, batch: SequenceBatch, data_sources: Sequence[str]) -> LogProbs:
        return self._routed(batch, data_sources, lambda teacher, part: teacher.compute_logprobs(part))

    def compute_top_k(self, batch: SequenceBatch, k: int, data_sources: Sequence[str]) -> TopK:
        return self._routed(batch, data_sources, lambda teacher, part: teacher.compute_top_k(part, k))

    def shutdown(self) -> None:
        for teacher in (self.main, *self.per_data_source.values()):
            teacher.shutdown()

    def _routed(self, batch: SequenceBatch, data_sources: Sequence[str], call) -> tuple[list, list]:
        """``call(teacher, its sequences)`` per teacher, its two per-sequence lists put back in batch order."""
        if len(data_sources) != len(batch):
            raise ValueError(f"{len(data_sources)} data sources for a batch of {len(batch)} sequences")
        shares: dict = {}
        for index, source in enumerate(data_sources):
            shares.setdefault(source if source in self.per_data_source else None, []).append(index)
        if list(shares) == [None]:  # the main teacher alone: the batch as it is
            return call(self.main, batch)
        teacher_of = lambda source: self.main if source is None else self.per_data_source[source]  # noqa: E731
        with ThreadPoolExecutor(max_workers=len(shares)) as pool:
            answers = {source: pool.submit(call, teacher_of(source), batch.select(indices))
                       for source, indices in shares.items()}
            first, second = [None] * len(batch), [None] * len(batch)
            for source, indices in shares.items():
                part_first, part_second = answers[source].result()
                for position, index in enumerate(indices):
                    first[index], second[index] = part_first[position], part_second[position]
        return first, second


def role_groups(ranks: RankCalls, *, reference: bool, critic: bool) -> tuple[ActorGroup, Optional[ReferenceGroup],
                                                                                  Optional[CriticGroup]]:
    return ActorGroup(ranks), ReferenceGroup(ranks) if reference else None, CriticGroup(ranks) if critic else None

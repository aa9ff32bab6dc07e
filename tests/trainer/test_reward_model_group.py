"""``RewardModelGroup.score`` reaches every rank's reward worker and answers with rank 0's scores,
and the frozen reward model is neither offloaded with the trained roles nor checkpointed."""

import torch

from rlmega.trainer.roles import RewardModel, RewardModelGroup
from rlmega.trainer.training_group import RankProcess
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import WorkerConfig

from .fakes import in_process_ranks


class _Worker:
    def __init__(self, rank: int, role: str):
        self.rank, self.config, self.offloaded, self.batches = rank, WorkerConfig(role=role), False, []

    def compute_scores(self, batch):
        self.batches.append(batch)
        return torch.full((len(batch),), float(self.rank))

    def offload(self):
        self.offloaded = True
        return 1

    def save_checkpoint(self, root, extra, step):
        return root


def _processes():
    processes = [RankProcess(rank, 2) for rank in range(2)]
    for process in processes:
        process.workers = {"actor": _Worker(process.rank, "actor"), "reward": _Worker(process.rank, "reward")}
        process.reference_warm_started = False
    return processes


def test_score_calls_every_rank_and_returns_rank_0s_scores():
    processes = _processes()
    group: RewardModel = RewardModelGroup(in_process_ranks(processes))
    batch = SequenceBatch([torch.arange(5), torch.arange(3)], [2, 1])
    assert torch.equal(group.score(batch), torch.zeros(2))
    assert all(process.workers["reward"].batches == [batch] for process in processes)


def test_the_reward_model_is_not_offloaded_with_the_trained_roles_nor_saved(tmp_path):
    process = _processes()[0]
    assert process.set_offloaded(True) == 1
    assert process.workers["actor"].offloaded and not process.workers["reward"].offloaded
    assert set(process.save(str(tmp_path), {"step": 3})) == {"actor"}

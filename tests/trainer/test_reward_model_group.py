"""``RewardModelGroup.score`` reaches every rank's reward worker and answers with rank 0's scores,
and the frozen reward model is neither offloaded with the trained roles nor checkpointed."""

import torch

from rlmega.trainer.roles import RewardModel, RewardModelGroup
from rlmega.trainer.training_group import RankCalls, RankProcess
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import WorkerConfig


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


class _Method:
    def __init__(self, function):
        self.remote = function


class _Handle:
    """What the groups see of a rank: ``handle.method.remote(...)``, here answered at once."""

    def __init__(self, process: RankProcess):
        self._process = process

    def __getattr__(self, name):
        return _Method(getattr(self._process, name))


class _Ranks(RankCalls):
    def __init__(self, processes):
        self.handles = [_Handle(process) for process in processes]

    def _on_ranks(self, call, what, timeout_s=None):
        return [call(handle) for handle in self.handles]


def _processes():
    processes = [RankProcess(rank, 2) for rank in range(2)]
    for process in processes:
        process.workers = {"actor": _Worker(process.rank, "actor"), "reward": _Worker(process.rank, "reward")}
        process.reference_warm_started = False
    return processes


def test_score_calls_every_rank_and_returns_rank_0s_scores():
    processes = _processes()
    group: RewardModel = RewardModelGroup(_Ranks(processes))
    batch = SequenceBatch([torch.arange(5), torch.arange(3)], [2, 1])
    assert torch.equal(group.score(batch), torch.zeros(2))
    assert all(process.workers["reward"].batches == [batch] for process in processes)


def test_the_reward_model_is_not_offloaded_with_the_trained_roles_nor_saved(tmp_path):
    process = _processes()[0]
    assert process.set_offloaded(True) == 1
    assert process.workers["actor"].offloaded and not process.workers["reward"].offloaded
    assert set(process.save(str(tmp_path), {"step": 3})) == {"actor"}

"""``TeacherGroup`` reaches every rank's teacher worker and answers with rank 0's results; ``Teachers`` sends each
sequence to its data source's teacher and puts the answers back in batch order."""

import pytest
import torch

from rlmega.trainer.roles import Teacher, TeacherGroup, Teachers
from rlmega.trainer.training_group import RankProcess
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import WorkerConfig

from .fakes import in_process_ranks


class _Worker:
    def __init__(self, rank: int):
        self.rank, self.config, self.calls = rank, WorkerConfig(role="teacher"), []

    def compute_logprobs(self, batch):
        self.calls.append(("logprobs", batch))
        return ([torch.full((n,), float(self.rank)) for n in batch.response_lengths],
                [torch.zeros(n) for n in batch.response_lengths])

    def compute_top_k(self, batch, k):
        self.calls.append(("top_k", batch, k))
        return ([torch.full((n, k), self.rank, dtype=torch.long) for n in batch.response_lengths],
                [torch.zeros(n, k) for n in batch.response_lengths])


def _batch(lengths) -> SequenceBatch:
    """Sequence i: prompt of 2 tokens, i + 1 + ... response tokens, its first token i (to find it again)."""
    return SequenceBatch([torch.tensor([index, 0] + [1] * length) for index, length in enumerate(lengths)],
                         [2] * len(lengths))


def test_teacher_group_calls_every_rank_and_returns_rank_0s_results():
    processes = [RankProcess(rank, 2) for rank in range(2)]
    for process in processes:
        process.workers = {"teacher": _Worker(process.rank)}
    ranks = in_process_ranks(processes)
    group: Teacher = TeacherGroup(ranks)
    batch = _batch([3, 1])
    logprobs, _ = group.compute_logprobs(batch)
    ids, top = group.compute_top_k(batch, 4)
    assert [t.tolist() for t in logprobs] == [[0.0] * 3, [0.0]]
    assert [t.shape for t in ids] == [(3, 4), (1, 4)] and all(int(t.max()) == 0 for t in ids)
    assert all([call[0] for call in p.workers["teacher"].calls] == ["logprobs", "top_k"] for p in processes)
    group.shutdown()
    assert ranks.shut


class _Tagged:
    """A teacher whose answers say which teacher and which sequence they are for."""

    def __init__(self, tag: float):
        self.tag, self.batches, self.shut = tag, [], False

    def compute_logprobs(self, batch):
        self.batches.append(batch)
        return ([torch.full((n,), self.tag + int(tokens[0])) for n, tokens in zip(batch.response_lengths, batch.tokens)],
                [torch.full((n,), -self.tag) for n in batch.response_lengths])

    def compute_top_k(self, batch, k):
        self.batches.append(batch)
        return ([torch.full((n, k), int(tokens[0])) for n, tokens in zip(batch.response_lengths, batch.tokens)],
                [torch.full((n, k), self.tag) for n in batch.response_lengths])

    def shutdown(self):
        self.shut = True


def test_each_sequence_goes_to_its_data_sources_teacher_and_comes_back_in_order():
    main, math, code = _Tagged(100.0), _Tagged(200.0), _Tagged(300.0)
    teachers = Teachers(main, {"math": math, "code": code})
    sources = ["math", "gsm8k", "code", "math", "other", "code"]
    batch = _batch([2, 3, 1, 4, 2, 3])
    logprobs, entropies = teachers.compute_logprobs(batch, sources)
    tags = {"math": 200.0, "code": 300.0}
    for index, (source, values) in enumerate(zip(sources, logprobs)):
        tag = tags.get(source, 100.0)
        assert values.tolist() == [tag + index] * batch.response_lengths[index]
        assert entropies[index].tolist() == [-tag] * batch.response_lengths[index]
    assert [int(t[0]) for t in math.batches[0].tokens] == [0, 3]  # each teacher saw its own sequences only
    assert [int(t[0]) for t in main.batches[0].tokens] == [1, 4]
    ids, top = teachers.compute_top_k(batch, 3, sources)
    assert [int(t[0, 0]) for t in ids] == list(range(6))
    assert [float(t[0, 0]) for t in top] == [tags.get(source, 100.0) for source in sources]
    assert all(t.shape == (n, 3) for t, n in zip(ids, batch.response_lengths))
    teachers.shutdown()
    assert main.shut and math.shut and code.shut


def test_a_batch_of_the_main_teacher_alone_is_passed_whole():
    main = _Tagged(1.0)
    teachers = Teachers(main, {"code": _Tagged(2.0)})
    batch = _batch([2, 2])
    teachers.compute_logprobs(batch, ["math", "math"])
    assert main.batches == [batch]
    with pytest.raises(ValueError, match="1 data sources for a batch of 2 sequences"):
        teachers.compute_logprobs(batch, ["math"])

"""The stateful sampler: per-epoch shuffled orders from a seed, and exact resumption from a saved state."""

import itertools

import pytest

from rlmega.data import StatefulSampler


def _take(sampler, num_batches):
    return list(itertools.islice(iter(sampler), num_batches))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = StatefulSampler(num_items=10, batch_size=5, seed=3)
    batches = _take(sampler, 4)
    first_epoch = batches[0] + batches[1]
    second_epoch = batches[2] + batches[3]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(10))
    assert first_epoch != second_epoch and first_epoch != list(range(10))
    assert StatefulSampler(10, 5, seed=3).epoch_order(0) == first_epoch
    assert StatefulSampler(10, 5, seed=4).epoch_order(0) != first_epoch


def test_drop_last_skips_the_tail_and_keep_last_yields_a_short_batch():
    dropping = StatefulSampler(num_items=7, batch_size=3, seed=0)
    assert dropping.steps_per_epoch == 2
    assert [len(batch) for batch in _take(dropping, 4)] == [3, 3, 3, 3]
    assert dropping.epoch == 1
    keeping = StatefulSampler(num_items=7, batch_size=3, seed=0, drop_last=False)
    assert keeping.steps_per_epoch == 3
    batches = _take(keeping, 4)
    assert [len(batch) for batch in batches] == [3, 3, 1, 3]
    assert sorted(batches[0] + batches[1] + batches[2]) == list(range(7))


def test_unshuffled_order_is_the_dataset_order():
    assert _take(StatefulSampler(5, 2, shuffle=False, drop_last=False), 4) == [[0, 1], [2, 3], [4], [0, 1]]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_yields_the_same_batches_as_an_uninterrupted_run(stop_after, drop_last):
    uninterrupted = _take(StatefulSampler(num_items=11, batch_size=4, seed=7, drop_last=drop_last), 12)

    interrupted = StatefulSampler(num_items=11, batch_size=4, seed=7, drop_last=drop_last)
    before = _take(interrupted, stop_after)
    state = dict(interrupted.state_dict())  # as a checkpoint would store it

    resumed = StatefulSampler(num_items=11, batch_size=4, seed=7, drop_last=drop_last)
    resumed.load_state_dict(state)
    after = _take(resumed, 12 - stop_after)
    assert before + after == uninterrupted


def test_load_state_refuses_a_different_seed_or_dataset():
    state = StatefulSampler(num_items=10, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved seed=1 differs"):
        StatefulSampler(num_items=10, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved num_items=10 differs"):
        StatefulSampler(num_items=12, batch_size=2, seed=1).load_state_dict(state)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size 8 is larger than the dataset"):
        StatefulSampler(num_items=5, batch_size=8)
    with pytest.raises(ValueError, match="num_items must be >= 1"):
        StatefulSampler(num_items=0, batch_size=1)

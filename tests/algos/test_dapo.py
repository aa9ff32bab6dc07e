"""DAPO dynamic sampling, soft overlong punishment and overlong filtering."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmega.algos import count_loss_denominators, dynamic_sampling_filter, overlong_filter_mask, overlong_reward_penalty

from .helpers import PROPERTY_SETTINGS


def test_dynamic_sampling_by_hand() -> None:
    # a = (1, 1) constant -> drop; b = (0, 1) -> keep; c singleton -> keep (as verl); d = (0, 0.5) -> keep
    group_ids = ["a", "b", "a", "c", "b", "d", "d"]
    accuracy = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    result = dynamic_sampling_filter(group_ids, accuracy)
    assert result.keep_mask.tolist() == [False, True, False, True, True, True, True]
    assert result.kept_indices.tolist() == [1, 3, 4, 5, 6]
    assert result.num_kept_groups == 3
    assert result.num_dropped_groups == 1


def test_dynamic_sampling_with_tensor_ids_and_integer_metric() -> None:
    result = dynamic_sampling_filter(torch.tensor([5, 5, 9, 9]), torch.tensor([1, 0, 1, 1]))
    assert result.kept_indices.tolist() == [0, 1]
    assert (result.num_kept_groups, result.num_dropped_groups) == (1, 1)


def test_dynamic_sampling_rejects_bad_metric_shape() -> None:
    with pytest.raises(ValueError, match=r"metric must be \[B\]"):
        dynamic_sampling_filter([0, 0], torch.zeros(2, 1))
    with pytest.raises(ValueError, match="B = 3 entries, got 2"):
        dynamic_sampling_filter([0, 0], torch.zeros(3))


@PROPERTY_SETTINGS
@given(layout=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2)), min_size=1, max_size=16))
def test_dynamic_sampling_keeps_exactly_the_non_constant_groups_and_singletons(layout: list[tuple[int, int]]) -> None:
    group_ids = [group for group, _ in layout]
    metric = torch.tensor([float(value) for _, value in layout])
    result = dynamic_sampling_filter(group_ids, metric)
    values_by_group: dict[int, set[float]] = {}
    for group, value in layout:
        values_by_group.setdefault(group, set()).add(float(value))
    expected_kept = {group for group, values in values_by_group.items()
                     if len(values) > 1 or group_ids.count(group) == 1}
    assert result.keep_mask.tolist() == [group in expected_kept for group in group_ids]
    assert result.num_kept_groups == len(expected_kept)
    assert result.num_dropped_groups == len(values_by_group) - len(expected_kept)


def test_overlong_penalty_by_hand() -> None:
    # L_max = 20, L_cache = 4: free up to 16; 17 -> (16-17)/4 = -0.25; 18 -> -0.5; 20 -> -1; beyond -> -1
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_length=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    halved = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_length=4, penalty_factor=0.5)
    torch.testing.assert_close(halved, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_response_length": 20, "overlong_buffer_length": 0}, "overlong_buffer_length"),
        ({"max_response_length": 20, "overlong_buffer_length": 21}, "overlong_buffer_length"),
        ({"max_response_length": 20, "overlong_buffer_length": 4, "penalty_factor": -1.0}, "penalty_factor"),
    ],
)
def test_overlong_penalty_rejects_bad_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_reward_penalty(torch.tensor([1]), **kwargs)


def test_overlong_filter_by_hand() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    filtered = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert filtered.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert filtered.dtype == mask.dtype
    # the filtered sample counts neither as tokens nor as a sequence in the loss denominators
    counts = count_loss_denominators(filtered)
    assert (counts.num_tokens.item(), counts.num_seqs.item()) == (3, 2)


def test_overlong_filter_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"truncated must be \[B\].*\[2\]"):
        overlong_filter_mask(torch.ones(3, 2), torch.tensor([True, False]))

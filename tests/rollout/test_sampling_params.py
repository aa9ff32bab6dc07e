"""SamplingParams validation: every bad field is rejected with its name in the message."""

import pytest

from rlmega.rollout import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", True),
    ("top_k", 0), ("top_k", 2.0),
    ("max_new_tokens", 0), ("max_new_tokens", True),
    ("n", 0), ("n", 1.0),
    ("seed", -1),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", "12"), ("stop_token_ids", 3), ("stop_token_ids", [1.0]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_good_values_are_kept_and_stop_ids_become_a_tuple():
    params = SamplingParams(temperature=0, top_p=1.0, top_k=1, max_new_tokens=1, stop_token_ids=[0, 7], n=4, seed=0)
    assert params.stop_token_ids == (0, 7)
    assert (params.temperature, params.top_k, params.n, params.seed) == (0, 1, 4, 0)
    assert hash(params) == hash(SamplingParams(temperature=0, top_k=1, max_new_tokens=1, stop_token_ids=(0, 7),
                                               n=4, seed=0))

"""``rollout.weight_dtype``: validated once, handed to the engine, and the post-sync tolerance follows it."""

import pytest

from rlmega.config.load import check_settings, load_config
from rlmega.config.schema import POST_SYNC_ATOL_FP32, POST_SYNC_ATOL_FP8
from rlmega.errors import UserError


def _settings(*overrides):
    """The config with its settings checked (no model or data: the quickstart builds those itself)."""
    config = load_config("tiny_cpu", list(overrides), check=False)
    check_settings(config)
    return config


def test_fp8_reaches_every_backend_and_widens_the_post_sync_tolerance():
    config = _settings("rollout.weight_dtype=fp8")
    assert config.rollout.engine_arguments() == {"weight_dtype": "fp8"}
    assert config.post_sync_atol() == POST_SYNC_ATOL_FP8
    assert _settings("rollout.weight_dtype=fp8", "sync.post_sync_atol=0.3").post_sync_atol() == 0.3
    vllm = load_config("tiny_cpu", ["rollout.weight_dtype=fp8", "rollout.backend=vllm"], check=False)
    assert vllm.rollout.engine_arguments()["weight_dtype"] == "fp8"
    default = _settings()
    assert "weight_dtype" not in default.rollout.engine_arguments()
    assert default.post_sync_atol() == POST_SYNC_ATOL_FP32


def test_bad_weight_dtype_names_the_field_and_the_choices():
    with pytest.raises(UserError, match="rollout.weight_dtype.*auto.*fp8"):
        _settings("rollout.weight_dtype=int4")
    with pytest.raises(UserError, match="rollout.engine_kwargs.weight_dtype: set rollout.weight_dtype instead"):
        _settings("+rollout.engine_kwargs.weight_dtype=fp8")

"""Checkpoints shared by the rollout tests (built once per session, read-only afterwards)."""

import pytest

from .tiny_models import save_tiny_model


def _checkpoint(tmp_path_factory, name: str, seed: int):
    return save_tiny_model(name, tmp_path_factory.mktemp(f"{name}-{seed}"), seed)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "llama", seed=0)


@pytest.fixture(scope="session")
def llama_other_dir(tmp_path_factory):
    """Same architecture, different weights: the target of weight updates."""
    return _checkpoint(tmp_path_factory, "llama", seed=1)


@pytest.fixture(scope="session")
def qwen3_moe_dirs(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen3-moe", seed=0), _checkpoint(tmp_path_factory, "qwen3-moe", seed=1)


@pytest.fixture(scope="session")
def mixtral_dirs(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "mixtral", seed=0), _checkpoint(tmp_path_factory, "mixtral", seed=1)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gpt2", seed=0)

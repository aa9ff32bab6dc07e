"""Checkpoints for the sync tests, and a guard that no test leaves a shared-memory region behind."""

import glob

import pytest

from rlmega.sync.shared_memory import SHM_PREFIX
from rollout.tiny_models import save_tiny_model


def shm_regions() -> set[str]:
    return set(glob.glob(f"/dev/shm/{SHM_PREFIX}*"))


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = shm_regions()
    yield
    leaked = shm_regions() - before
    assert not leaked, f"shared-memory regions left behind: {sorted(leaked)}"


@pytest.fixture(scope="session")
def start_dir(tmp_path_factory):
    """The engines' initial checkpoint (weight version 0)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("sync-start"), 0)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """Same architecture, other weights: what the updates carry."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("sync-target"), 1)

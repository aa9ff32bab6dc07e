"""Checkpoints for the sync tests, and a guard that no test leaves a shared-memory region behind."""

import glob
from pathlib import Path

import pytest

from rlmega.sync.shared_memory import SHM_PREFIX
from rollout.tiny_models import save_tiny_model


def shm_regions() -> set[str]:
    """This test run's regions: each is named after the process that made it, and one made by a live process
    outside this one's tree belongs to another job on the machine (a run beside the tests)."""
    import os

    from rlmega.launch.guardian import process_tree

    ours = process_tree(os.getpid())
    regions = set()
    for path in glob.glob(f"/dev/shm/{SHM_PREFIX}*"):
        maker = Path(path).name[len(SHM_PREFIX):].split("-")[0]
        if not maker.isdigit() or int(maker) in ours or not Path(f"/proc/{maker}").exists():
            regions.add(path)
    return regions


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

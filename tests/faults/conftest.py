"""Fixtures of the fault tests: the tiny run's assets, built once, and runs that are killed whatever the outcome."""

import pytest

from fault_helpers import Run
from rlmega.trainer.assets import prepare_tiny_assets


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    directory = tmp_path_factory.mktemp("assets")
    prepare_tiny_assets(directory, num_train=64, num_val=16)
    return directory


@pytest.fixture
def start_run(tmp_path, assets):
    """``start_run(name, *overrides)``: a ``Run`` in ``tmp_path/name``; every run's processes are killed at the end."""
    runs = []

    def start(name, *overrides, log_name=None, env=None):
        run = Run(tmp_path / name, assets, *overrides, name=log_name or f"{name}-{len(runs)}", env=env)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.stop()

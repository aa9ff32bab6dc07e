"""Fixtures of the fault tests: the tiny run's assets, built once, and runs that are killed whatever the outcome."""

import pytest

from fault_helpers import Run


@pytest.fixture(scope="session")
def assets(tiny_assets):
    return tiny_assets(num_train=64, num_val=16)


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

"""Shared pytest set-up: GPU-only tests are skipped, with their reason, where CUDA is absent; slow test phases are
named as they end; the tiny model and data are made once per session."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="GPU-only: needs CUDA, which this machine does not have")
    for item in items:
        # The marker itself: item.keywords also holds the names of parent nodes, so "gpu" would match
        # every test under tests/gpu/, the CPU contract tests beside the GPU ones included.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


SLOW_S = 45.0
"""A test phase longer than this is named on the console as it ends, with the time into the run: a slow or
cut-short run then shows where its time went."""
_session = {}


def pytest_sessionstart(session):
    import time

    _session.update(started=time.monotonic(), reporter=session.config.pluginmanager.get_plugin("terminalreporter"))


def pytest_runtest_logreport(report):
    import time

    if report.duration > SLOW_S and _session.get("reporter") is not None:
        minutes, seconds = divmod(int(time.monotonic() - _session["started"]), 60)
        _session["reporter"].write_line(f"\n[slow] {report.nodeid} ({report.when}): {report.duration:.0f} s, "
                                        f"{minutes}:{seconds:02d} into the run")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """``tiny_assets(**sizes)``: a directory holding the tiny model and arithmetic data (``prepare_tiny_assets`` with
    those arguments), made once per session for each set of arguments. Tests read it and must not change it."""
    from rlmega.trainer.assets import prepare_tiny_assets

    made = {}

    def directory_for(**sizes):
        key = tuple(sorted(sizes.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("assets")
            prepare_tiny_assets(made[key], **sizes)
        return made[key]

    return directory_for


@pytest.fixture
def local_ray():
    """A private one-CPU Ray for the test (nothing forwarded to the console), shut down after it."""
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 1024**2, log_to_driver=False)
    yield
    ray.shutdown()

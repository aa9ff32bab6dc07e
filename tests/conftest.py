"""Shared pytest set-up: GPU-only tests are skipped, with their reason, where CUDA is absent."""

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

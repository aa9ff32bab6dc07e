"""Cluster tier: how fast one thread copies host memory on the GPU node, the speed of vLLM's collective_rpc host
copies that the refit plan assumes (plan.host_copy_gb_per_s, 12.8 GB/s unless set). The check line prints the
measured speed and the setting to give ``rlmega plan``. CPU twin: tests/rollout/test_gpu_check_twins.py."""

import pytest

from .engine_checks import host_copy_gb_per_s

pytestmark = pytest.mark.gpu


def test_host_memcpy_speed():
    assert host_copy_gb_per_s() > 1.0  # GB/s: far below it, the buffers were swapped, not copied

"""A driver that joined a running Ray cluster (``cluster.ray_address``) and is killed with SIGKILL: Ray kills the
actors it owned (training ranks, engine), and the cluster itself is left as it was: no guardian runs for it."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fault_helpers import ONE_RANK, _cmdline, wait_for
from launch_helpers import descendants, free_ports, launch_env
from rlmega.launch.ray_cluster import RayNode, RayNodeSpec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def head():
    root = Path(tempfile.mkdtemp(prefix="rlm-", dir="/tmp"))  # short: Ray's sockets live under it
    gcs, agent = free_ports(2)
    env = launch_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    node = RayNode(RayNodeSpec(head=True, port=gcs, num_cpus=4, temp_dir=str(root), include_dashboard=False,
                               node_ip="127.0.0.1", extra_args=[f"--dashboard-agent-listen-port={agent}"]),
                   stdout=open(root / "head.log", "w"), env=env)
    try:
        address = f"127.0.0.1:{gcs}"
        waited = subprocess.run([sys.executable, "-m", "rlmega.launch.ray_cluster", "wait", "--address", address,
                                 "--num-nodes", "1", "--timeout", "120"], env=env, capture_output=True, text=True,
                                timeout=180)
        assert waited.returncode == 0, waited.stderr[-3000:]
        yield {"node": node, "address": address, "env": env}
    finally:
        node.stop(grace_s=10)
        shutil.rmtree(root, ignore_errors=True)


def _cluster_processes(node) -> set[int]:
    """The node's own processes (GCS, raylet, agents, ...), not its workers."""
    return {pid for pid in descendants(node.process.pid)
            if not _cmdline(pid).startswith("ray::") or _cmdline(pid).endswith("Agent")}


def test_killed_driver_of_a_joined_cluster_loses_its_actors_and_nothing_else(start_run, head):
    node = head["node"]
    cluster_before = _cluster_processes(node)
    run = start_run("run", "trainer.total_steps=40", *ONE_RANK, f"cluster.ray_address={head['address']}",
                    env={**head["env"], "RAY_ADDRESS": head["address"]})
    run.wait_step(1)

    def actors():
        return [pid for pid in descendants(node.process.pid)
                if _cmdline(pid).startswith(("ray::RankProcess", "ray::HFEngine"))]

    assert actors(), "the run's actors are not on the joined cluster"
    os.kill(run.pid, signal.SIGKILL)
    run.process.wait(timeout=30)
    wait_for(lambda: not actors(), 60, "Ray to kill the dead driver's actors", poll_s=0.2)
    assert node.alive()
    cluster_after = _cluster_processes(node)
    assert cluster_before <= cluster_after, cluster_before - cluster_after  # the cluster's own processes live on
    waited = subprocess.run([sys.executable, "-m", "rlmega.launch.ray_cluster", "wait", "--address", head["address"],
                             "--num-nodes", "1", "--timeout", "30"], env=head["env"], capture_output=True, text=True,
                            timeout=60)
    assert waited.returncode == 0, waited.stderr[-3000:]  # and it still takes drivers

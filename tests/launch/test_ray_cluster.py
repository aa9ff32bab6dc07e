"""A two-node Ray cluster on one host (head + worker from ``ray start``, distinct ports and temp
dirs, told apart by custom resources) runs the tiny job, directly and through ``ray job submit``."""

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from launch_helpers import (
    REPO,
    assert_finished,
    engine_node_ids,
    free_ports,
    kill_mentioning,
    launch_env,
)

from rlmega.launch import ray_job
from rlmega.launch.ray_cluster import RayNode, RayNodeSpec, interface_ip, node_ip

pytestmark = pytest.mark.timeout(300)


def test_ray_start_command_binds_the_dashboard_to_loopback_by_default():
    head = RayNodeSpec(head=True, port=7000, node_ip="10.0.0.1", num_cpus=4, temp_dir="/tmp/r")
    cmd = head.command()
    assert {"--head", "--block", "--port=7000", "--dashboard-host=127.0.0.1",
            "--node-ip-address=10.0.0.1", "--num-cpus=4", "--temp-dir=/tmp/r"} <= set(cmd)
    worker = RayNodeSpec(head=False, head_address="10.0.0.1:7000", extra_args=["--resources={}"])
    assert "--address=10.0.0.1:7000" in worker.command() and worker.command()[-1] == "--resources={}"
    with pytest.raises(ValueError, match="head_address"):
        RayNodeSpec(head=False).command()


def test_node_ip_from_interface_and_environment(monkeypatch):
    assert interface_ip("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="interfaces here: .*lo"):
        interface_ip("no-such-nic0")
    monkeypatch.setenv("RAY_NODE_IP", "10.1.2.3")
    assert node_ip() == "10.1.2.3"
    monkeypatch.delenv("RAY_NODE_IP")
    monkeypatch.setenv("NODE_IP_INTERFACE", "lo")
    assert node_ip() == "127.0.0.1"


def test_ray_job_runtime_env_uploads_the_checkout_without_large_dirs():
    args = ray_job.build_parser().parse_args(
        ["--env", "A=1", "--exclude", "data", "--", "train", "run_dir=/x"])
    args.train_args = args.train_args[1:]
    cmd = ray_job.submit_command(args)
    env = json.loads(cmd[cmd.index("--runtime-env-json") + 1])
    assert env["working_dir"] == str(REPO)
    assert {".venv", ".git", "runs", "checkpoints", "data"} <= set(env["excludes"])
    assert env["env_vars"]["A"] == "1"
    assert cmd[cmd.index("--") + 1:] == [
        "python", "-m", "rlmega.cli.main", "train", "run_dir=/x", "cluster.ray_address=auto"]


@pytest.fixture(scope="module")
def two_nodes():
    """Head (with the dashboard, for ray job submit, on loopback) and one worker on this host."""
    root = Path(tempfile.mkdtemp(prefix="rlm-", dir="/tmp"))
    gcs, dashboard, client, agent0, agent1 = free_ports(5)
    env = launch_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    address = f"{node_ip()}:{gcs}"
    nodes = []
    try:
        nodes.append(RayNode(RayNodeSpec(
            head=True, port=gcs, num_cpus=4, temp_dir=str(root / "head"), include_dashboard=True,
            dashboard_port=dashboard,
            extra_args=[f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent0}",
                        '--resources={"rlmega_test_head": 1}']),
            stdout=open(root / "head.log", "w"), env=env))
        nodes.append(RayNode(RayNodeSpec(
            head=False, head_address=address, num_cpus=4, temp_dir=str(root / "worker"),
            extra_args=[f"--dashboard-agent-listen-port={agent1}",
                        '--resources={"rlmega_test_worker": 1}']),
            stdout=open(root / "worker.log", "w"), env=env))
        waited = subprocess.run(
            [sys.executable, "-m", "rlmega.launch.ray_cluster", "wait", "--address", address,
             "--num-nodes", "2", "--timeout", "120", "--print-nodes"],
            env=env, capture_output=True, text=True, timeout=180)
        assert waited.returncode == 0, waited.stderr[-3000:]
        alive = json.loads(waited.stdout.strip().splitlines()[-1])
        node_id = {name: next(n["NodeID"] for n in alive if name in n["Resources"])
                   for name in ("rlmega_test_head", "rlmega_test_worker")}
        yield {"address": address, "dashboard": f"http://127.0.0.1:{dashboard}", "root": root,
               "env": env, "node_ids": set(node_id.values())}
    finally:
        for node in reversed(nodes):
            node.stop(grace_s=10)
        kill_mentioning(str(root))
        shutil.rmtree(root, ignore_errors=True)


def test_tiny_job_places_engines_on_both_nodes(two_nodes, driver):
    run_dir = two_nodes["root"] / "run-direct"
    env = dict(two_nodes["env"], RAY_ADDRESS=two_nodes["address"])
    started = time.monotonic()
    result = subprocess.run(
        driver.train(f"run_dir={run_dir}", "cluster.ray_address=auto", *driver.overrides(spread_engines=True)),
        env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_finished(run_dir, 3)
    assert set(engine_node_ids(run_dir)) == two_nodes["node_ids"]
    print(f"direct run on the two-node cluster: {time.monotonic() - started:.1f}s")


def test_ray_job_submit_runs_the_tiny_job(two_nodes, driver):
    run_dir = two_nodes["root"] / "run-job"
    if driver.name == "stub":
        prefix = "python tests/launch/stub_rlmega.py"  # relative: proves the working_dir upload
    else:
        prefix = "python -m rlmega.cli.main"
    cmd = [sys.executable, "-m", "rlmega.launch.ray_job", "--address", two_nodes["dashboard"],
           "--entrypoint-prefix", prefix, "--",
           "train", "--config", "tiny_cpu", f"run_dir={run_dir}", *driver.overrides(spread_engines=True)]
    result = subprocess.run(cmd, env=two_nodes["env"], cwd=REPO, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout + result.stderr
    assert_finished(run_dir, 3)
    assert set(engine_node_ids(run_dir)) == two_nodes["node_ids"]

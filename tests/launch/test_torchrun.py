"""``torchrun --nnodes 2 --nproc-per-node 1 -m rlmega.launch.torchrun`` with two launcher processes
on this host (through ``rlmega.launch.checked_torchrun``, torchrun with its rendezvous checked first): the
tiny job end to end, and a dead node ending the launch with its name."""

import re
import subprocess
import sys
import time

import pytest
from launch_helpers import (
    REPO,
    assert_finished,
    engine_node_ids,
    free_port_prefix,
    free_ports,
    kill_group,
    kill_tree,
    launch_env,
)

pytestmark = pytest.mark.timeout(300)

CHECKED_TORCHRUN = [sys.executable, "-m", "rlmega.launch.checked_torchrun"]


def start_launchers(scratch, driver_command, heartbeat_timeout=60, static=False):
    """Two torchrun processes (one per "node"), each in its own process group; their logs.

    c10d rendezvous assigns node ranks in its own order; ``static`` fixes launcher i as node i
    (its store on node 0), so a test knows which one to kill."""
    rdzv, gcs, dashboard, client = free_ports(4)
    agent = free_port_prefix()
    env = launch_env()
    launchers, logs = [], []
    for index in range(2):
        log_path = scratch / f"launcher{index}.log"
        if static:
            rendezvous = ["--rdzv-backend", "static", "--node-rank", str(index),
                          "--master-addr", "127.0.0.1", "--master-port", str(rdzv)]
        else:
            rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}"]
        cmd = [
            *CHECKED_TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", *rendezvous,
            "--max-restarts", "0", "-m", "rlmega.launch.torchrun",
            "--ray-port", str(gcs), "--num-cpus", "4", "--include-dashboard", "false",
            "--temp-dir", str(scratch / "ray{rank}"), "--log-dir", str(scratch / "ray-logs"),
            "--heartbeat-timeout", str(heartbeat_timeout), "--join-timeout", "120",
            # Two nodes on one host need distinct ports for what Ray does not choose at random.
            "--ray-start-args",
            f"--dashboard-port={dashboard} --ray-client-server-port={client} "
            f"--dashboard-agent-listen-port={agent}{{rank}} --resources='{{\"rlmega_node{{rank}}\": 1}}'",
            "--", *driver_command,
        ]
        logs.append(log_path)
        launchers.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log_path, "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return launchers, logs


def wait_all(launchers, timeout):
    deadline = time.monotonic() + timeout
    codes = []
    for launcher in launchers:
        codes.append(launcher.wait(timeout=max(1, deadline - time.monotonic())))
    return codes


def test_two_agents_of_one_launch_share_a_host_and_its_rendezvous_port():
    """With c10d, the second agent on the endpoint's host finds the port taken by the first one's store: a
    store answers there, so the launch goes on."""
    port, = free_ports(1)
    command = [*CHECKED_TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-python", sys.executable, "-c", "pass"]
    agents = [subprocess.Popen(command, env=launch_env(), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            kill_group(agent)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)[-4000:]


def test_torchrun_two_nodes_runs_the_tiny_job(scratch, driver):
    run_dir = scratch / "run"
    launchers, logs = start_launchers(
        scratch, driver.train(f"run_dir={run_dir}", *driver.overrides(spread_engines=True)))
    started = time.monotonic()
    try:
        codes = wait_all(launchers, timeout=260)
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for launcher in launchers:
            kill_group(launcher)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-6000:]
    assert_finished(run_dir, 3)
    assert len(set(engine_node_ids(run_dir))) == 2, "engines should run on both nodes"
    assert "all 2 Ray nodes joined" in output
    assert len(list((scratch / "ray-logs").iterdir())) == 2, "each node's Ray logs are copied"
    print(f"torchrun two nodes: {time.monotonic() - started:.1f}s")


@pytest.mark.parametrize("dead", [1, 0], ids=["worker-dies", "head-dies"])
def test_a_dead_node_ends_the_launch_naming_it(scratch, dead):
    # The driver never touches the other node: only the launchers can notice its death. Static
    # rendezvous keeps torchrun's own agents out of it (with c10d, the agent of the node that hosts
    # the rendezvous store takes the others down with it).
    launchers, logs = start_launchers(
        scratch, [sys.executable, "-c", "import time; time.sleep(600)"], heartbeat_timeout=8,
        static=True)
    try:
        deadline = time.monotonic() + 120
        while "running the driver" not in "".join(log.read_text() for log in logs):
            assert time.monotonic() < deadline, "the launch never reached the driver"
            assert all(launcher.poll() is None for launcher in launchers)
            time.sleep(1)
        kill_tree(launchers[dead].pid)  # the whole "machine" of that node
        killed_at = time.monotonic()
        try:
            code = launchers[1 - dead].wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - killed_at
    finally:
        for launcher in launchers:
            kill_group(launcher)
    output = logs[1 - dead].read_text()
    assert code not in (0, None), output[-4000:]
    if dead == 1:
        assert re.search(r"node 1 \(\S+\) (sent no heartbeat|failed)", output), output[-4000:]
    else:
        assert re.search(r"lost the store at .* \(node 0, \S+\)|node 0 \(\S+\) sent no heartbeat",
                         output), output[-4000:]
    assert elapsed < 40, f"the surviving node took {elapsed:.0f}s to notice"

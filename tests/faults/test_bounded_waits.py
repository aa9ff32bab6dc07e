"""Ports that would make a launch wait without end, or end in a traceback: a rendezvous port held by another
program, a ``cluster.ray_address`` where no Ray head answers, a Ray head's port in use. Each launch ends on its own
within a bound, with one line naming the address and what to change. The ports are held by listening sockets of the
test's own on 127.0.0.1 (all addresses where Ray, which replaces a loopback address by the node's, must see it)."""

import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch_helpers import REPO, free_ports, kill_group, launch_env

pytestmark = pytest.mark.timeout(180)

LIMIT_S = 120  # generous: each of these ends in seconds once it stops waiting without end


@pytest.fixture
def held_port():
    """A port of this host held by a listening socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def ray_dir():
    """A short temp dir for Ray's session files (its Unix sockets live under it)."""
    path = Path(tempfile.mkdtemp(prefix="rlm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _finish(command: list, env=None) -> tuple[int, str]:
    """Run ``command`` in a session of its own to its end (killed with its children at ``LIMIT_S``): exit code
    (None when it had to be killed) and its output."""
    process = subprocess.Popen(command, cwd=REPO, env=env or launch_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=LIMIT_S)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        kill_group(process)
        return None, process.stdout.read()
    finally:
        kill_group(process)


def _error_line(output: str) -> str:
    """The one error line; no traceback before it."""
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if "error:" in line or line.startswith("rlmega train:")]
    assert len(errors) == 1, output[-4000:]
    return errors[0]


CHECKED_TORCHRUN = [sys.executable, "-m", "rlmega.launch.checked_torchrun", "--nproc-per-node", "1",
                    "--max-restarts", "0"]


def test_torchrun_rendezvous_port_held_by_another_program_ends_in_one_line(held_port):
    code, output = _finish([*CHECKED_TORCHRUN, "--nnodes", "2", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{held_port}", "--no-python", "true"])
    assert code == 2, output[-4000:]
    line = _error_line(output)
    assert f"127.0.0.1:{held_port}" in line and "not a torch rendezvous store" in line, line
    assert "pick another port with --rdzv-endpoint" in line, line


def test_static_rendezvous_port_in_use_on_node_0_ends_in_one_line(held_port):
    code, output = _finish([*CHECKED_TORCHRUN, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                            "--master-port", str(held_port), "--no-python", "true"])
    assert code == 2, output[-4000:]
    line = _error_line(output)
    assert f"port {held_port}" in line and "already in use" in line and "--master-port" in line, line


def test_rendezvous_that_nobody_joins_times_out_in_one_line():
    port, = free_ports(1)
    code, output = _finish([*CHECKED_TORCHRUN, "--nnodes", "2", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=3",
                            "--no-python", "true"])
    assert code == 1, output[-4000:]
    line = _error_line(output)
    assert f"rendezvous at 127.0.0.1:{port} (c10d) timed out" in line and "join_timeout=3" in line, line


@pytest.mark.parametrize("where", ["held", "closed"])
def test_a_run_joining_no_ray_cluster_ends_in_one_line(start_run, held_port, where):
    port = held_port if where == "held" else free_ports(1)[0]
    run = start_run("run", f"cluster.ray_address=127.0.0.1:{port}", "cluster.connect_timeout_s=3")
    try:
        code = run.process.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        code = None
    output = run.output()
    assert code == 2, output[-4000:]
    line = _error_line(output)
    assert line.startswith(f"rlmega train: no Ray cluster answers at 127.0.0.1:{port}"), line
    assert "within 3 s" in line and "ray start --head" in line and "cluster.ray_address empty" in line, line


def test_ray_head_port_in_use_ends_in_one_line(held_port, ray_dir):
    code, output = _finish([sys.executable, "-m", "rlmega.launch.ray_cluster", "node", "--head",
                            "--port", str(held_port), "--include-dashboard", "false", "--temp-dir", str(ray_dir)])
    assert code == 2, output[-4000:]
    line = _error_line(output)
    assert f"port {held_port} for the Ray head (GCS) is already in use" in line and "--port" in line, line


def test_torchrun_launchers_ray_head_port_in_use_ends_in_one_line(held_port, ray_dir):
    rendezvous, = free_ports(1)
    code, output = _finish([*CHECKED_TORCHRUN, "--nnodes", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{rendezvous}", "-m", "rlmega.launch.torchrun",
                            "--ray-port", str(held_port), "--temp-dir", str(ray_dir / "ray{rank}"),
                            "--include-dashboard", "false", "--", sys.executable, "-c", "pass"])
    assert code == 2, output[-4000:]
    assert "starting Ray head" not in output, output[-4000:]
    line = _error_line(output)
    assert f"port {held_port} for the Ray head (GCS) is already in use" in line and "--ray-port" in line, line

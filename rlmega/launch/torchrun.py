"""Bring up Ray under torchrun, one launcher process per node, and run a driver command on node 0.

    python -m rlmega.launch.checked_torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT -m rlmega.launch.torchrun [options] -- rlmega train --config tiny_cpu run_dir=...

(``checked_torchrun`` is torchrun with its rendezvous endpoint checked first; plain ``torchrun`` works too.)

torchrun gives every launcher its node rank (``GROUP_RANK``, or ``RANK`` with one process per node)
and a key-value store on node 0 (``MASTER_ADDR:MASTER_PORT``). Through that store:

1. node 0 checks that the Ray head's port is free (else every node stops, naming it), starts the head and
   publishes its address; the others wait for it and join;
2. node 0 waits until all N nodes are alive in Ray, then runs the driver with ``RAY_ADDRESS`` set
   (SIGTERM/SIGINT to the launcher are forwarded to the driver: preemption checkpoints work);
3. node 0 publishes the driver's exit code; every node stops its Ray node (its own processes, never
   ``ray stop``) and exits with that code, so torchrun reports the same status on every node.

Every node bumps a heartbeat counter in the store. A node whose counter stops moving for
``--heartbeat-timeout`` seconds, a node whose Ray process dies, or a store that stops answering (node 0
is gone) ends the launch on every node within about that time, with a message naming the node.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed import DistError

from rlmega.errors import UserError
from rlmega.launch.ports import require_free_port
from rlmega.launch.ray_cluster import (
    RayNode,
    RayNodeSpec,
    ensure_auth_token,
    log,
    node_ip,
    wait_for_nodes,
)

KEY_PREFIX = "rlmega-launch/"
# torchrun's per-process variables describe the launchers' group, not the job's. Left in the
# environment of Ray and of the driver, torch.distributed in the training ranks would join (or, with
# TORCHELASTIC_USE_AGENT_STORE, wait for) the launchers' store instead of its own.
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
                      "ROLE_WORLD_SIZE", "NODE_RANK")
POLL_S = 1.0


class LaunchError(RuntimeError):
    """The launch cannot go on: a node died, timed out, or never joined."""


class LockedStore:
    """torchrun's store, shared by the main thread and the heartbeat thread."""

    def __init__(self, store):
        self._store = store
        self._lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self._lock:
            self._store.set(key, value)

    def get(self, key: str) -> str:
        with self._lock:
            return self._store.get(key).decode()

    def check(self, key: str) -> bool:
        with self._lock:
            return self._store.check([key])

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return self._store.add(key, amount)


class Peers:
    """Heartbeats (a thread bumps this node's counter) and failure reports of all nodes."""

    def __init__(self, store: LockedStore, rank: int, num_nodes: int, heartbeat_timeout_s: float):
        self.store = store
        self.rank = rank
        self.heartbeat_timeout_s = heartbeat_timeout_s
        now = time.monotonic()
        self.last_seen: Dict[int, Tuple[int, float]] = {r: (-1, now) for r in range(num_nodes)}
        self.store_error: Optional[BaseException] = None
        self.parent = os.getppid()  # this node's torchrun agent
        self.hosts: Dict[int, str] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="rlmega-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                self.store.add(f"heartbeat/{self.rank}", 1)
            except DistError as error:
                self.store_error = error
                return

    def stop(self) -> None:
        self._stopped.set()

    def report_failure(self, message: str) -> None:
        try:
            self.store.set(f"failed/{self.rank}", message)
        except DistError:  # the store itself may be what failed
            pass

    def host(self, rank: int) -> str:
        if rank not in self.hosts:
            try:
                if self.store.check(f"host/{rank}"):
                    self.hosts[rank] = self.store.get(f"host/{rank}")
            except DistError:
                pass
        return self.hosts.get(rank, "host unknown")

    def check(self, ranks: List[int]) -> None:
        """Raise naming the first of ``ranks`` that reported a failure or went silent."""
        if self.store_error is not None:
            raise self.store_error
        if os.getppid() != self.parent:
            raise LaunchError(f"node {self.rank}'s torchrun agent (pid {self.parent}) exited")
        now = time.monotonic()
        for rank in ranks:
            if self.store.check(f"failed/{rank}"):
                reason = self.store.get(f"failed/{rank}")
                raise LaunchError(f"node {rank} ({self.host(rank)}) failed: {reason}")
            count = self.store.add(f"heartbeat/{rank}", 0)
            previous, since = self.last_seen[rank]
            if count != previous:
                self.last_seen[rank] = (count, now)
            elif now - since > self.heartbeat_timeout_s:
                raise LaunchError(
                    f"node {rank} ({self.host(rank)}) sent no heartbeat for "
                    f"{now - since:.0f}s (--heartbeat-timeout {self.heartbeat_timeout_s:.0f})"
                )


def node_rank_from_env() -> tuple:
    """(node rank, number of nodes) from torchrun's variables; one launcher per node."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        raise LaunchError(
            "run one launcher per node: torchrun --nproc-per-node 1 (each launcher starts one "
            f"Ray node); this is local rank {os.environ['LOCAL_RANK']}"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise LaunchError(f"not started by torchrun: {', '.join(missing)} unset")
    rank = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or os.environ.get("RANK", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(rank), world_size // local_world_size


def connect_store(timeout_s: float) -> LockedStore:
    """torchrun's store at MASTER_ADDR:MASTER_PORT; LaunchError naming it when it does not answer in time."""
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    except (DistError, RuntimeError, TimeoutError, ValueError) as error:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LaunchError(
            f"could not join torchrun's store at {address} within {timeout_s:.0f}s ({reason}); check that "
            "the address is node 0's and reachable from this node, or wait longer with --join-timeout"
        ) from None
    return LockedStore(dist.PrefixStore(KEY_PREFIX, store))


def wait_for_key(store: LockedStore, key: str, peers: Peers, watch: List[int], timeout_s: float,
                 what: str) -> str:
    deadline = time.monotonic() + timeout_s
    while not store.check(key):
        peers.check(watch)
        if time.monotonic() > deadline:
            raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(POLL_S)
    return store.get(key)


def job_env() -> Dict[str, str]:
    """This process's environment without torchrun's variables (see TORCHRUN_VARIABLES)."""
    return {name: value for name, value in os.environ.items()
            if name not in TORCHRUN_VARIABLES and not name.startswith("TORCHELASTIC_")}


def ray_spec(args: argparse.Namespace, rank: int, head: bool, head_address: Optional[str]) -> RayNodeSpec:
    return RayNodeSpec(
        head=head,
        port=args.ray_port,
        head_address=head_address,
        node_ip=node_ip(args.interface, args.node_ip_address),
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        temp_dir=args.temp_dir.format(rank=rank),
        include_dashboard=args.include_dashboard,
        dashboard_host=args.dashboard_host,
        extra_args=shlex.split(args.ray_start_args.replace("{rank}", str(rank))),
    )


class Driver:
    """The driver command on node 0, in its own process group; SIGTERM/SIGINT are forwarded."""

    def __init__(self, command: List[str], ray_address: str):
        env = dict(job_env(), RAY_ADDRESS=ray_address)
        log(f"running the driver with RAY_ADDRESS={ray_address}: {shlex.join(command)}")
        self.process = subprocess.Popen(command, env=env, start_new_session=True)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)

    def _forward(self, signum, _frame) -> None:
        log(f"forwarding {signal.Signals(signum).name} to the driver; waiting for it to exit")
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def run_head(args, store, peers: Peers, num_nodes: int) -> int:
    require_free_port(args.ray_port, "the Ray head (GCS)", "pick a free one with --ray-port (or RAY_PORT)")
    # The token travels to the other nodes through torchrun's store, never on a command line.
    token = ensure_auth_token(generate=True)
    store.set("auth_mode", os.environ["RAY_AUTH_MODE"])
    if token:
        store.set("auth_token", token)
    node = RayNode(ray_spec(args, 0, head=True, head_address=None), env=job_env())
    workers = list(range(1, num_nodes))
    try:
        address = f"{node.spec.node_ip}:{args.ray_port}"
        store.set("head_address", address)

        def check() -> None:
            peers.check(workers)
            if not node.alive():
                raise LaunchError("node 0's Ray head exited while nodes were joining")

        wait_for_nodes(address, num_nodes, args.join_timeout, check=check)
        driver = Driver(args.command, address)
        try:
            while driver.process.poll() is None:
                peers.check(workers)
                if not node.alive():
                    raise LaunchError("node 0's Ray head exited during the run")
                time.sleep(POLL_S)
        except BaseException:
            driver.kill()
            raise
        code = driver.process.returncode
        if code < 0:  # killed by a signal: report it the way a shell does
            code = 128 - code
        log(f"driver exited with code {code}")
        store.set("exit_code", str(code))
        acknowledge_deadline = time.monotonic() + args.heartbeat_timeout
        # The store lives as long as node 0's torchrun: keep it up until every node has read the code.
        while time.monotonic() < acknowledge_deadline:
            if store.add("exit_code_read", 0) >= len(workers):
                break
            time.sleep(0.2)
        return code
    finally:
        stop_node(node, args, "head")


def run_worker(args, store, peers: Peers, rank: int) -> int:
    head_address = wait_for_key(store, "head_address", peers, [0], args.join_timeout,
                                "node 0 to start the Ray head")
    peers.host(0)  # remembered, to name node 0 if it is lost
    os.environ["RAY_AUTH_MODE"] = store.get("auth_mode")
    if store.check("auth_token"):
        os.environ["RAY_AUTH_TOKEN"] = store.get("auth_token")
    node = RayNode(ray_spec(args, rank, head=False, head_address=head_address), env=job_env())
    try:
        while not store.check("exit_code"):
            peers.check([0])
            if not node.alive():
                raise LaunchError(f"node {rank}'s Ray worker exited during the run")
            time.sleep(POLL_S)
        code = int(store.get("exit_code"))
        store.add("exit_code_read", 1)
        log(f"node 0's driver exited with code {code}")
        return code
    finally:
        stop_node(node, args, f"worker{rank}")


def stop_node(node: RayNode, args, name: str) -> None:
    node.stop()
    if args.log_dir:
        copied = node.copy_logs(args.log_dir, f"{socket.gethostname()}-{name}")
        if copied:
            log(f"Ray logs copied to {copied}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m rlmega.launch.torchrun",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    parser.add_argument("--ray-port", type=int, default=int(env("RAY_PORT", "6379")),
                        help="the head's GCS port (default $RAY_PORT or 6379)")
    parser.add_argument("--node-ip-address", help="this node's address for Ray (default $RAY_NODE_IP)")
    parser.add_argument("--interface", help="take this node's address from an interface (default $NODE_IP_INTERFACE)")
    parser.add_argument("--num-cpus", type=int, help="CPUs Ray offers on this node (default: detected)")
    parser.add_argument("--num-gpus", type=int, help="GPUs Ray offers on this node (default: detected)")
    parser.add_argument("--temp-dir", default=env("RAY_TMPDIR_ROOT", "/tmp/rlmega-ray-{rank}"),
                        help="Ray's session files on this node; {rank} is the node rank "
                        "(default /tmp/rlmega-ray-{rank}; keep it short)")
    parser.add_argument("--log-dir", help="copy each node's Ray logs here when it stops")
    parser.add_argument("--include-dashboard", type=lambda s: s.lower() in ("1", "true", "yes"),
                        default=True, help="true|false: run the dashboard on the head (default true)")
    parser.add_argument("--dashboard-host", default=env("RAY_DASHBOARD_HOST", "127.0.0.1"),
                        help="dashboard bind address (default $RAY_DASHBOARD_HOST or 127.0.0.1)")
    parser.add_argument("--ray-start-args", default=env("RAY_START_ARGS", ""),
                        help="more 'ray start' options, one string; {rank} becomes the node rank (default $RAY_START_ARGS)")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds to wait for the head and for all nodes to join (default 600)")
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0,
                        help="seconds of silence after which a node counts as dead (default 60)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- the driver command run on node 0, e.g. rlmega train ...")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        log("error: give the driver command after --, e.g. -- rlmega train --config tiny_cpu")
        return 2
    try:
        rank, num_nodes = node_rank_from_env()
        store = connect_store(args.join_timeout)
    except LaunchError as error:
        log(f"error: {error}")
        return 2
    store.set(f"host/{rank}", socket.gethostname())
    peers = Peers(store, rank, num_nodes, args.heartbeat_timeout)
    # A launcher stopped by torchrun (or by hand) stops its Ray node on the way out; once node 0
    # runs the driver, SIGTERM goes to the driver instead (see Driver).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log(f"node {rank} of {num_nodes}")
    try:
        if rank == 0:
            return run_head(args, store, peers, num_nodes)
        return run_worker(args, store, peers, rank)
    except UserError as error:
        log(f"error: {error}")
        peers.report_failure(str(error))
        return 2
    except (LaunchError, TimeoutError) as error:
        log(f"error: {error}")
        peers.report_failure(str(error))
        return 1
    except DistError as error:  # the store's connection broke: node 0's torchrun is gone
        log(f"error: lost the store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"(node 0, {peers.host(0)}): {str(error).splitlines()[0]}")
        return 1
    finally:
        peers.stop()


if __name__ == "__main__":
    sys.exit(main())

"""One Ray node per host, started and stopped by the launchers, and waiting until all have joined.

A node is ``ray start --block`` run as a child in its own session: SIGTERM to it drains the node and
stops exactly the processes it started. ``ray stop`` is never called, because it kills every Ray
process on the host, including other jobs' and other users' clusters.

The SLURM scripts use this module as a command (``srun ... python -m rlmega.launch.ray_cluster node``);
the torchrun bootstrap imports it.

    python -m rlmega.launch.ray_cluster node-ip [--interface IF]
    python -m rlmega.launch.ray_cluster node --head --port P [options] [-- extra ray start args]
    python -m rlmega.launch.ray_cluster node --address HEAD:P [options] [-- extra ray start args]
    python -m rlmega.launch.ray_cluster wait --address HEAD:P --num-nodes N [--timeout S]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from rlmega.errors import UserError
from rlmega.launch.guardian import signal_when_parent_dies
from rlmega.launch.ports import ray_head_problem, require_free_port, split_address

SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a network interface
GCS_ANSWER_S = 30.0
"""A head's GCS that accepts connections answers at once: what stays silent this long is not a Ray head."""


def log(message: str) -> None:
    print(f"rlmega.launch [{socket.gethostname()}]: {message}", file=sys.stderr, flush=True)


def ensure_auth_token(generate: bool) -> Optional[str]:
    """Token authentication for the Ray processes this launcher starts (they inherit os.environ).

    ``RAY_AUTH_MODE`` defaults to ``token``. Without ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``,
    a fresh token is made when ``generate`` (the head's launcher) and returned, for the caller to
    hand to the other nodes. ``RAY_AUTH_MODE=disabled`` turns authentication off.
    """
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode != "token" or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    if generate and not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return os.environ.get("RAY_AUTH_TOKEN")


def interface_ip(interface: str) -> str:
    """The IPv4 address of ``interface`` (e.g. ``ib0``, ``eth1``); an error names the interfaces present."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError as error:
            present = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(
                f"no IPv4 address on interface {interface!r} ({error.strerror}); "
                f"interfaces here: {present}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def node_ip(interface: Optional[str] = None, explicit: Optional[str] = None) -> str:
    """This host's address for Ray, in order: ``explicit``, ``$RAY_NODE_IP``, ``interface``,
    ``$NODE_IP_INTERFACE``, then Ray's own choice (the interface of the default route)."""
    explicit = explicit or os.environ.get("RAY_NODE_IP")
    if explicit:
        return explicit
    interface = interface or os.environ.get("NODE_IP_INTERFACE")
    if interface:
        return interface_ip(interface)
    import ray.util

    return ray.util.get_node_ip_address()


def wait_for_port(host: str, port: int, timeout_s: float, what: str, check=None) -> None:
    """Block until ``host:port`` accepts TCP connections; TimeoutError naming ``what`` otherwise.
    ``check()``, called between attempts, may raise to give up early."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check:
            check()
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{what} at {host}:{port} not reachable after {timeout_s:.0f}s ({error})"
                ) from None
        time.sleep(0.5)


@dataclass
class RayNodeSpec:
    """What ``ray start`` needs for one node; every port not given is Ray's default or random."""

    head: bool
    port: int = 6379
    """GCS port of the head (the head listens on it; workers connect to it)."""
    head_address: Optional[str] = None
    """HOST:PORT of the head; required for a worker node."""
    node_ip: Optional[str] = None
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None
    temp_dir: Optional[str] = None
    """Root of this node's Ray session files (keep it short: Unix sockets live under it)."""
    include_dashboard: bool = True
    dashboard_host: str = "127.0.0.1"
    dashboard_port: Optional[int] = None
    extra_args: List[str] = field(default_factory=list)
    """Passed through to ``ray start`` (``--resources``, port ranges, ...)."""

    def command(self) -> List[str]:
        ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        cmd = [ray, "start", "--block", "--disable-usage-stats"]
        if self.head:
            cmd += ["--head", f"--port={self.port}"]
            cmd += [f"--include-dashboard={str(self.include_dashboard).lower()}"]
            cmd += [f"--dashboard-host={self.dashboard_host}"]
            if self.dashboard_port is not None:
                cmd += [f"--dashboard-port={self.dashboard_port}"]
        else:
            if not self.head_address:
                raise ValueError("a worker node needs head_address (HOST:PORT)")
            cmd += [f"--address={self.head_address}"]
        if self.node_ip:
            cmd += [f"--node-ip-address={self.node_ip}"]
        if self.num_cpus is not None:
            cmd += [f"--num-cpus={self.num_cpus}"]
        if self.num_gpus is not None:
            cmd += [f"--num-gpus={self.num_gpus}"]
        if self.temp_dir:
            cmd += [f"--temp-dir={self.temp_dir}"]
        return cmd + list(self.extra_args)


def _terminate_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL (Linux), so no node leaks."""
    signal_when_parent_dies(signal.SIGTERM)


class RayNode:
    """A running ``ray start --block``; :meth:`stop` drains it and stops its processes only."""

    def __init__(self, spec: RayNodeSpec, stdout=None, env: Optional[Dict[str, str]] = None):
        self.spec = spec
        self.command = spec.command()
        log(("starting Ray head: " if spec.head else "starting Ray worker: ") + " ".join(self.command))
        self.process = subprocess.Popen(
            self.command, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_terminate_with_parent, env=env,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log(f"Ray node did not stop within {grace_s:.0f}s; killing it")
        # Whatever the node left in its session (drained or not) is killed.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def copy_logs(self, log_dir: str, name: str) -> Optional[Path]:
        """Copy this node's Ray logs (``<temp_dir>/session_latest/logs``) to ``log_dir/name``."""
        source = Path(self.spec.temp_dir or "/tmp/ray") / "session_latest" / "logs"
        if not source.is_dir():
            return None
        target = Path(log_dir) / name
        try:
            shutil.copytree(source, target, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        except (OSError, shutil.Error) as error:  # logs are a convenience: never fail the job for them
            log(f"could not copy all Ray logs to {target}: {error}")
        return target


def wait_for_nodes(
    address: str, num_nodes: int, timeout_s: float, poll_s: float = 1.0, check=None
) -> List[Dict]:
    """Connect to the cluster at ``address`` and wait until ``num_nodes`` nodes are alive.

    ``check()``, called between polls, may raise to give up early (a node's launcher failed).
    Raises TimeoutError listing the nodes that did join. Disconnects before returning.
    """
    import ray

    host, port = split_address(address)
    wait_for_port(host, port, timeout_s, "Ray head (GCS)", check)
    # ray.init would wait for minutes on a port held by a program that is not Ray.
    problem = ray_head_problem(address, min(timeout_s, GCS_ANSWER_S))
    if problem:
        raise TimeoutError(f"no Ray cluster answers at {address}: {problem}")
    deadline = time.monotonic() + timeout_s
    ray.init(address=address, log_to_driver=False, logging_level="WARNING", include_dashboard=False)
    try:
        while True:
            nodes = [node for node in ray.nodes() if node.get("Alive")]
            if len(nodes) >= num_nodes:
                log(f"all {num_nodes} Ray nodes joined: " + describe(nodes))
                return nodes
            if check:
                check()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of {num_nodes} Ray nodes joined {address} within "
                    f"{timeout_s:.0f}s: {describe(nodes) or 'none'}; see the missing nodes' logs"
                )
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def describe(nodes: Sequence[Dict]) -> str:
    return ", ".join(
        f"{node['NodeManagerAddress']}:{node['NodeManagerPort']} ({node['NodeID'][:8]})"
        for node in nodes
    )


def _run_node(args: argparse.Namespace, extra: List[str]) -> int:
    """The ``node`` command: run one Ray node until SIGTERM/SIGINT, then copy its logs."""
    if not args.head and not args.address:
        raise SystemExit("node: give --head or --address HEAD:PORT")
    if args.head:
        require_free_port(args.port, "the Ray head (GCS)",
                          "pick a free one with --port (RAY_PORT for launch/slurm/train.sbatch)")
    spec = RayNodeSpec(
        head=args.head,
        port=args.port,
        head_address=args.address,
        node_ip=node_ip(args.interface, args.node_ip_address),
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        temp_dir=args.temp_dir,
        include_dashboard=args.include_dashboard,
        dashboard_host=args.dashboard_host,
        dashboard_port=args.dashboard_port,
        extra_args=extra,
    )
    if not args.head:
        wait_for_port(*split_address(args.address), args.join_timeout, "Ray head (GCS)")
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append(True))
    node = RayNode(spec)
    try:
        while node.alive() and not stop_requested:
            time.sleep(0.5)
        code = node.process.poll()
        if code is not None and not stop_requested:
            log(f"Ray node exited by itself with code {code}")
    finally:
        # Under srun, SLURM signals every process of the step at once, so Ray's own drain would
        # wait for processes that are already gone: the grace period bounds it.
        node.stop(args.stop_grace)
        if args.log_dir:
            name = args.log_name.format(host=socket.gethostname(), role="head" if args.head else "worker")
            copied = node.copy_logs(args.log_dir, name)
            if copied:
                log(f"Ray logs copied to {copied}")
    return 0 if stop_requested else 1


def _wait(args: argparse.Namespace) -> int:
    try:
        nodes = wait_for_nodes(args.address, args.num_nodes, args.timeout)
    except TimeoutError as error:
        log(f"error: {error}")
        return 1
    if args.print_nodes:
        keys = ("NodeID", "NodeManagerAddress", "NodeManagerHostname", "Resources")
        print(json.dumps([{key: node.get(key) for key in keys} for node in nodes]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlmega.launch.ray_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    ip = commands.add_parser("node-ip", help="print this host's address for Ray")
    ip.add_argument("--interface", help="network interface (default: $NODE_IP_INTERFACE)")

    node = commands.add_parser("node", help="run one Ray node until SIGTERM, then copy its logs")
    role = node.add_mutually_exclusive_group()
    role.add_argument("--head", action="store_true", help="start the head node")
    role.add_argument("--address", help="HOST:PORT of the head, to start a worker node")
    node.add_argument("--port", type=int, default=6379, help="head's GCS port (default 6379)")
    node.add_argument("--node-ip-address", help="this node's address (default: $RAY_NODE_IP)")
    node.add_argument("--interface", help="take the address of this interface (default: $NODE_IP_INTERFACE)")
    node.add_argument("--num-cpus", type=int)
    node.add_argument("--num-gpus", type=int)
    node.add_argument("--temp-dir", help="root of Ray's session files on this node (keep it short)")
    node.add_argument("--include-dashboard", type=lambda s: s.lower() in ("1", "true", "yes"),
                      default=True, help="true|false (default true; only on the head)")
    node.add_argument("--dashboard-host", default="127.0.0.1", help="default 127.0.0.1: not reachable from other hosts")
    node.add_argument("--dashboard-port", type=int)
    node.add_argument("--log-dir", help="copy the node's Ray logs to LOG_DIR/LOG_NAME when it stops")
    node.add_argument("--log-name", default="{host}-{role}",
                      help="{host} and {role} (head|worker) are filled in (default {host}-{role})")
    node.add_argument("--stop-grace", type=float, default=15.0,
                      help="seconds Ray gets to drain after SIGTERM before it is killed (default 15)")
    node.add_argument("--join-timeout", type=float, default=300.0,
                      help="seconds a worker waits for the head's port (default 300)")

    wait = commands.add_parser("wait", help="wait until N nodes are alive in the cluster")
    wait.add_argument("--address", required=True, help="HOST:PORT of the head")
    wait.add_argument("--num-nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    wait.add_argument("--print-nodes", action="store_true", help="print the alive nodes as JSON")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    args = build_parser().parse_args(argv)
    if args.command == "node-ip":
        try:
            print(node_ip(args.interface))
        except ValueError as error:
            log(f"error: {error}")
            return 2
        return 0
    if args.command == "node":
        try:
            return _run_node(args, extra)
        except UserError as error:
            log(f"error: {error}")
            return 2
    return _wait(args)


if __name__ == "__main__":
    sys.exit(main())

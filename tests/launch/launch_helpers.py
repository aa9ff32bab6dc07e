"""Helpers for the launcher tests: the trainer command, free ports, clean-up, reading run outputs."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Set

from rlmega.launch.guardian import process_tree

REPO = Path(__file__).resolve().parents[2]
STUB = Path(__file__).with_name("stub_rlmega.py")
VENV_BIN = Path(sys.executable).parent


@dataclass
class Driver:
    """The trainer command and the overrides that make a short run of it."""

    name: str  # "real" or "stub"
    command: List[str]  # what comes before `train`

    def overrides(self, total_steps: int = 3, spread_engines: bool = False, slow: bool = False) -> List[str]:
        """A short run; ``spread_engines``: two engines of their own, one per node."""
        args = [f"trainer.total_steps={total_steps}", "trainer.save_every=1"]
        if spread_engines:
            args += ["rollout.num_engines=2", "rollout.placement=disaggregated",
                     "rollout.engine_spread=spread"]
        if self.name == "stub":
            args.append(f"stub.step_seconds={3 if slow else 0.5}")
        else:  # the launch is under test, not learning: no warm-start, no validation, small batches
            args += ["trainer.sft_steps=0", "trainer.val_every=0", "trainer.prompts_per_step=4",
                     "rollout.n=4"]
        return args

    def train(self, *args: str) -> List[str]:
        return [*self.command, "train", "--config", "tiny_cpu", *args]


def free_ports(count: int) -> List[int]:
    """Distinct ports free right now (outside Ray's default worker port range 10002-19999)."""
    sockets, ports = [], []
    while len(ports) < count:
        sock = socket.socket()
        sock.bind(("", 0))
        port = sock.getsockname()[1]
        sockets.append(sock)
        if port not in ports and not 10002 <= port <= 19999:
            ports.append(port)
    for sock in sockets:
        sock.close()
    return ports


def free_port_prefix(num_nodes: int = 2) -> int:
    """P such that ports P0, P1, ... (P * 10 + node rank) are free: for ``{rank}`` in ray start args."""
    for prefix in random.sample(range(2000, 6500), 200):
        try:
            for rank in range(num_nodes):
                with socket.socket() as sock:
                    sock.bind(("", prefix * 10 + rank))
        except OSError:
            continue
        return prefix
    raise RuntimeError("no free port prefix found")


def launch_env(**extra: str) -> Dict[str, str]:
    """Environment for launcher processes: this venv first on PATH, no inherited Ray address."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    env.update(extra)
    return env


def pids_mentioning(marker: str) -> Set[int]:
    """Processes whose command line contains ``marker`` (a path unique to one test)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.add(int(entry.name))
    return found


def kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def descendants(pid: int) -> Set[int]:
    """``pid`` and every process below it (torchrun starts its workers in new sessions)."""
    return process_tree(pid)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once: a machine that dies."""
    for victim in descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_mentioning(marker: str) -> None:
    """Kill, by pid, what is left of the processes this test started (identified by its temp dir)."""
    for pid in pids_mentioning(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_metrics(run_dir: Path) -> List[Dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_dir(run_dir: Path) -> Path:
    """The directory holding ``latest_checkpointed_iteration.txt``: ``checkpoints/`` (the stand-in)
    or the actor's ``checkpoints/actor/`` (the trainer)."""
    markers = sorted((run_dir / "checkpoints").glob("**/latest_checkpointed_iteration.txt"),
                     key=lambda path: len(path.parts))
    return markers[0].parent if markers else run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> int:
    marker = checkpoint_dir(run_dir) / "latest_checkpointed_iteration.txt"
    return int(marker.read_text().strip()) if marker.exists() else 0


def engine_node_ids(run_dir: Path) -> List[str]:
    """Ray node ids of the rollout engines, from placement.json."""
    placement = json.loads((run_dir / "placement.json").read_text())
    return [engine["node_id"] for engine in placement["engines"]]


def assert_finished(run_dir: Path, total_steps: int) -> None:
    steps = [row["step"] for row in read_metrics(run_dir)]
    assert steps and max(steps) == total_steps, f"metrics.jsonl steps: {steps}"
    assert latest_checkpoint(run_dir) == total_steps
    assert (checkpoint_dir(run_dir) / f"iter_{total_steps:07d}").is_dir()

"""Starting a tiny ``rlmega train`` run, seeing what its processes are doing, killing them, and checking that
nothing of the run is left. Processes are watched through ``/proc`` (Linux): Ray names a worker's process
``ray::RankProcess.<method>`` while it runs that method, which is how a test lands a kill inside the
checkpoint save or the weight sync without any hook in the trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))            # trainer.test_trainer_runs: the tiny run's overrides, metric rows
sys.path.insert(0, str(HERE.parent / "launch"))  # launch_helpers

from launch_helpers import descendants, launch_env  # noqa: E402
from trainer.test_trainer_runs import TINY, _comparable, _rows  # noqa: E402,F401

# A run on the tiny config goes without Ray by default (cluster.in_process); ``Run`` starts it on Ray
# (``cluster.in_process=never``) unless a test says otherwise: most of these tests kill and watch Ray's processes (rank
# and engine actors, the guardian).
ONE_RANK = ["layout.tp=1", "layout.world_size=1"]
POLL_S = 0.005


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, process: Optional[subprocess.Popen] = None,
             poll_s: float = 0.05):
    """Poll ``condition`` until it returns something true (returned); AssertionError naming ``what`` after
    ``timeout_s``, or at once if ``process`` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run exited (code {process.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


class Run:
    """One ``rlmega train`` process on the tiny config in ``run_dir``, its output in ``run_dir/../<name>.log``."""

    def __init__(self, run_dir: Path, assets: Path, *overrides: str, name: str = "run",
                 env: Optional[dict] = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "assets").exists():
            (run_dir / "assets").symlink_to(assets)
        self.run_dir = run_dir
        self.log = run_dir.parent / f"{name}.log"
        self.started = time.time()
        if not any(override.startswith("cluster.in_process=") for override in overrides):
            overrides = (*overrides, "cluster.in_process=never")  # Ray's processes, unless a test asks otherwise
        command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *TINY, *overrides]
        with open(self.log, "w") as log:
            # A session of its own: a kill of the driver's process group by the test would hide what the
            # guardian does, and a signal from a terminal must not reach it.
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**launch_env(PYTHONUNBUFFERED="1"), **(env or {})})
        self.tree: dict[int, int] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def new_rows(self) -> list[dict]:
        """The metrics rows written by this process (the file is rewritten on resume: older ones are cut)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists() or path.stat().st_mtime < self.started:
            return []
        try:
            return _rows(self.run_dir)
        except ValueError:  # a row being written
            return []

    def last_step(self) -> int:
        rows = self.new_rows()
        return rows[-1]["step"] if rows else 0

    def wait_step(self, step: int, timeout_s: float = 240.0) -> None:
        wait_for(lambda: self.last_step() >= step, timeout_s, f"step {step} of {self.run_dir.name}", self.process,
                 poll_s=0.01)

    def wait_for_output(self, text: str, timeout_s: float = 240.0) -> str:
        """The first line of the run's output that contains ``text``."""
        def line():
            return next((line for line in self.output().splitlines() if text in line), None)
        return wait_for(line, timeout_s, f"{text!r} in the output of {self.run_dir.name}", self.process)

    def processes(self, title: str, timeout_s: float = 240.0) -> list[int]:
        """Pids of the run's processes whose command line starts with ``title`` (e.g. ``ray::RankProcess``)."""
        return wait_for(lambda: [pid for pid in descendants(self.pid) if _cmdline(pid).startswith(title)],
                        timeout_s, f"a process named {title}", self.process)

    def wait_title(self, pids: list[int], title: str, timeout_s: float = 120.0, also=lambda: True) -> None:
        """Return as soon as one of ``pids`` is named ``title`` (it runs that method) and ``also()`` holds."""
        wait_for(lambda: any(_cmdline(pid) == title for pid in pids) and also(), timeout_s,
                 f"a process named {title}", self.process, poll_s=POLL_S)

    def snapshot(self) -> None:
        """Remember every process of the run now ({pid: start time}), for ``assert_nothing_left``."""
        self.tree = {pid: start for pid in descendants(self.pid) if (start := _start_time(pid)) is not None}

    def kill_driver(self, snapshot: bool = True) -> None:
        """SIGKILL the driver alone (what a crash, an OOM killer or ``kill -9`` does), and reap it; ``snapshot``:
        first remember the run's processes (else the last ``snapshot()`` stands)."""
        if snapshot:
            self.snapshot()
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def assert_nothing_left(self, timeout_s: float = 60.0) -> None:
        """Every process of the run seen by the last snapshot has exited (polled: the guardian needs a moment)."""
        def left():
            return {pid: _cmdline(pid)[:100] for pid, start in self.tree.items()
                    if pid != self.pid and _start_time(pid) == start and _state(pid) not in ("Z", None)}
        try:
            wait_for(lambda: not left(), timeout_s, "the run's processes to exit", poll_s=0.2)
        except AssertionError:
            raise AssertionError(f"processes of the run still alive after {timeout_s:.0f} s: {left()}") from None

    def stop(self) -> None:
        """Clean-up, whatever the test's outcome: kill what is left of the run."""
        if self.process.poll() is None:
            self.snapshot()
        for pid, start in {**self.tree, self.pid: _start_time(self.pid)}.items():
            if start is not None and _start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _read(pid: int, name: str) -> Optional[bytes]:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    raw = _read(pid, "cmdline") or b""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _stat_fields(pid: int) -> Optional[list[str]]:
    raw = _read(pid, "stat")
    return raw.decode().rsplit(")", 1)[1].split() if raw else None


def _start_time(pid: int) -> Optional[int]:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _state(pid: int) -> Optional[str]:
    fields = _stat_fields(pid)
    return fields[0] if fields else None

"""A guardian that stops a driver's private Ray session when the driver dies, even by SIGKILL.

``ray.init(address="local")`` starts the GCS, the raylet and their helpers as the driver's children
and workers below the raylet. Ray ties the GCS and raylet to the driver, but not everything below
them: after ``kill -9`` of the driver, the raylet's agents (and, depending on the moment, worker
processes and what they started) outlive it. So before starting the session the driver calls
:func:`start_guardian`, which

- puts a fresh run token into the driver's environment (``RLMEGA_RUN_TOKEN``), which every process
  started from then on inherits: Ray's processes, its workers and their children, reward workers;
- starts ``python -m rlmega.launch.guardian`` in a session of its own (a signal to the driver's
  process group does not reach it), holding the read end of a pipe whose write end only the
  driver has.

While the driver lives, the guardian records its process tree every half second (pid and start
time, so a reused pid is never mistaken for one of ours). When the pipe reaches end-of-file or the
guardian's parent changes (the driver exited, however), it SIGKILLs what is left of that tree
(orphans included: they were recorded before the driver died), everything below those, and every
process whose environment still carries the token, until none is left, and exits. Processes of
other runs, of other Ray clusters, or of a cluster the driver joined (``cluster.ray_address``: its
processes were not started by the driver) are in neither record. Linux only (``/proc``); elsewhere
:func:`start_guardian` does nothing.

    python -m rlmega.launch.guardian LIFELINE_FD DRIVER_PID TOKEN
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

RUN_TOKEN_ENV = "RLMEGA_RUN_TOKEN"
SWEEP_LIMIT_S = 30.0
WATCH_INTERVAL_S = 0.5

_lifeline: Optional[int] = None
"""The write end of the guardian's pipe, held open for the life of the driver."""


def start_guardian() -> Optional[str]:
    """Start this process's guardian (once per process) and return the run token its children carry;
    None where there is no ``/proc`` (not Linux)."""
    global _lifeline
    if _lifeline is not None:
        return os.environ[RUN_TOKEN_ENV]
    if not sys.platform.startswith("linux") or not Path("/proc/self/environ").exists():
        return None
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    read_end, write_end = os.pipe()  # not inheritable: no other child holds the write end
    try:
        subprocess.Popen([sys.executable, "-m", "rlmega.launch.guardian", str(read_end), str(os.getpid()), token],
                         pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL, env=_guardian_env())
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    _lifeline = write_end
    os.environ[RUN_TOKEN_ENV] = token
    return token


def _guardian_env() -> dict[str, str]:
    import rlmega

    env = {name: value for name, value in os.environ.items() if name != RUN_TOKEN_ENV}
    package_root = str(Path(rlmega.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


PR_SET_PDEATHSIG = 1  # Linux prctl: the signal a process gets when its parent exits


def signal_when_parent_dies(signum: int) -> None:
    """In a child process: have the kernel send it ``signum`` when its parent dies, even by SIGKILL (Linux; nothing
    elsewhere). It fires when the parent's *thread* that started the child exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


def _stat(pid: int) -> Optional[tuple[int, int]]:
    """(parent pid, start time in clock ticks) of ``pid``; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def all_processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, start time)} of every process now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                found[int(entry.name)] = stat
    return found


def descendants(roots: dict[int, int], processes: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Every process below ``roots`` ({pid: start time}) in ``processes`` ({pid: (parent, start)}), roots included
    while they still run under the same start time (a pid may have been reused)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found = {pid: start for pid, start in roots.items() if pid in processes and processes[pid][1] == start}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = processes[child][1]
                todo.append(child)
    return found


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it now (by parent links, whatever session they are in)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in all_processes().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(children.get(current, []))
    return found


def processes_with_token(token: str) -> list[int]:
    """Pids of the processes whose environment still shows ``RLMEGA_RUN_TOKEN=token``. Not all do: a process
    that rewrites its title (Ray's agents and workers) may overwrite its environment block, so the process tree
    is the main record and the token a second one."""
    needle = f"{RUN_TOKEN_ENV}={token}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return found


def sweep(known: dict[int, int], token: str, limit_s: float = SWEEP_LIMIT_S) -> int:
    """SIGKILL the processes of ``known`` ({pid: start time}) that still run, everything below them and
    everything carrying ``token``, until a scan finds none (a dying parent may start a child meanwhile) or
    ``limit_s`` passes; how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        processes = all_processes()
        known = descendants(known, processes)
        for pid in processes_with_token(token):
            if pid in processes:
                known.setdefault(pid, processes[pid][1])
        known.pop(os.getpid(), None)
        alive = [pid for pid in known if pid not in killed or _running(pid)]
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    return len(killed)


def _running(pid: int) -> bool:
    """Not yet a zombie (a killed process stays in /proc until its new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _watch(lifeline: int, driver_pid: int) -> dict[int, int]:
    """Record the driver's process tree until the driver has gone (its pipe closed, or this process was
    re-parented); the last record, {pid: start time}: those of its processes that were orphaned by its death
    are no longer below it."""
    known: dict[int, int] = {}
    driver = {driver_pid: (_stat(driver_pid) or (0, 0))[1]}
    while os.getppid() == driver_pid:
        processes = all_processes()
        known = {**descendants(known, processes), **descendants(driver, processes)}
        ready, _, _ = select.select([lifeline], [], [], WATCH_INTERVAL_S)
        if ready and not os.read(lifeline, 4096):
            break
    known.pop(os.getpid(), None)
    known.pop(driver_pid, None)
    return known


def main(argv: list[str]) -> int:
    lifeline, driver_pid, token = int(argv[1]), int(argv[2]), argv[3]
    for name in ("SIGINT", "SIGHUP"):  # a terminal's signals are for the driver, not for its guardian
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    killed = sweep(_watch(lifeline, driver_pid), token)
    if killed:
        try:
            print(f"rlmega guardian: the driver (pid {driver_pid}) has exited; stopped {killed} processes of its "
                  "Ray session", file=sys.stderr, flush=True)
        except OSError:  # nobody reads the driver's stderr any more
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

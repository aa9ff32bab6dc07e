"""Training ranks 1..N-1 of a run in one process: plain child processes of the driver, which hosts rank 0
and the engine itself (``rlmega.trainer.in_process``).

A TP2 run on one machine does the same work as a one-rank run plus the tensor-parallel collectives, yet on Ray
its every call crosses process boundaries twice or more: the batch to each rank actor and the answers back,
generation in an engine actor, the weight sync from rank 0's process into the engine's, the version check.
On a small model those round trips cost as much as the arithmetic (``benchmarks/peer_trl.py``). Here rank 0
and the engine are objects of the driver, and only ranks 1..N-1 are processes of their own, each serving the
driver's calls over a pipe: the driver sends each child the call, makes rank 0's in its own thread, then reads
the children's answers. The ranks' collectives go between the processes directly (shared memory on this host,
``rlmega.parallel.host_collectives``, or gloo), as on Ray.

- **Failures.** A child that raises reports it and exits, so that rank 0, blocked in a collective with it, fails
  at once (the host collectives name an exited rank within 0.2 s; gloo sees the sockets close) and the driver
  reports the child's exception, the cause, rather than rank 0's. A child that dies is named with its exit code
  and its log. A child dies with the driver (``PR_SET_PDEATHSIG``), whatever kills the driver.
- **Engines stay in the driver.** Arguments that hold the driver's engine objects reach a child as None, which
  is what ranks other than 0 are given anyway (only rank 0 feeds the engine).
- **Output.** What a child prints goes to ``logs/workers/training-rank-<r>.log``, as a rank actor's would.
- **Start.** Children are new interpreters (a fork of a driver with torch's thread pools running is unsafe) that
  import torch and Megatron while rank 0 does the same.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from rlmega.trainer.remote import WorkerFailure
from rlmega.trainer.worker_logs import LOG_ENV

_POLL_S = 0.2
"""How often a wait on a child's answer checks that the child is alive."""
_EXIT_GRACE_S = 2.0
"""After rank 0 failed: how long to wait for a child's report, which would name the cause."""
SHUTDOWN_GRACE_S = 10.0
"""How long a child may take to leave its process group and exit after a shutdown."""


class _CallPickler(pickle.Pickler):
    """Pickles a call for a child, with the objects that must stay in the driver (its engines) left out."""

    def __init__(self, file, stays_here: tuple[type, ...]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._stays_here = stays_here

    def persistent_id(self, obj):
        return "stays in the driver" if isinstance(obj, self._stays_here) else None


class _CallUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return None  # a driver-only object (an engine): ranks other than 0 are given None for it anyway


class _Call:
    """``child.method.remote(*args)``: sends the call; the answer is read later (``RankChild.answer``)."""

    def __init__(self, child: RankChild, method: str):
        self._child, self._method = child, method

    def remote(self, *args, **kwargs) -> None:
        self._child.send(self._method, args, kwargs)


class RankChild:
    """One training rank as a child process of the driver, called through an actor handle's interface
    (``child.handle.update.remote(role, batch)``, the way the role groups call every rank)."""

    def __init__(self, rank: int, world_size: int, name: str, log: str, threads: int,
                 stays_here: tuple[type, ...] = ()):
        self.rank, self.name, self.log = rank, name, log
        self._stays_here = stays_here
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        # A process of its own from the start (not a multiprocessing child, which would import the driver's main
        # module first): all it prints, from its first import on, goes to its log.
        with open(log, "ab") as output, theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlmega.trainer.local_ranks", str(rank), str(world_size), str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                env={**os.environ, LOG_ENV: log, "OMP_NUM_THREADS": str(threads)})
        _started.add(self.process)
        self._pending = 0  # calls sent whose answers are not read yet

    @property
    def handle(self) -> _Handle:
        return _Handle(self)

    def send(self, method: str, args: tuple, kwargs: dict) -> None:
        buffer = io.BytesIO()
        _CallPickler(buffer, self._stays_here).dump((method, args, kwargs))
        try:
            self._conn.send_bytes(buffer.getbuffer())
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass  # it died: answer() says so
        self._pending += 1

    def answer(self, what: str, timeout_s: float) -> Any:
        """The answer to the oldest call not yet answered; WorkerFailure naming this rank if it raised, died or
        is late."""
        deadline = time.monotonic() + timeout_s
        self._pending -= 1
        try:
            while not self._conn.poll(_POLL_S):
                if self.process.poll() is not None:
                    raise self._died(what)
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"{what}: no answer from {self.name} within {timeout_s:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(what) from None
        if reply[0] == "raised":
            raise WorkerFailure(f"{what}: {self.name} raised {reply[1]}: {reply[2]}")
        return reply[1]

    def failed(self, what: str, within_s: float = _EXIT_GRACE_S) -> Optional[WorkerFailure]:
        """After rank 0 failed in ``what``: this child's own failure in it (it raised or died), if it shows within
        ``within_s``; None if it is alive and silent."""
        deadline = time.monotonic() + within_s
        while self._pending and time.monotonic() < deadline:
            if self._conn.poll(_POLL_S) or self.process.poll() is not None:
                try:
                    self.answer(what, timeout_s=_POLL_S)
                except WorkerFailure as failure:
                    return failure
        return None

    def _died(self, what: str) -> WorkerFailure:
        try:
            code = self.process.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exit code {code}" if code is not None else "its pipe closed")
        return WorkerFailure(f"{what}: {self.name} died ({how}); its output is in {self.log}")

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Wait up to ``grace_s`` for the child to exit after its last call; kill it if it does not."""
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=SHUTDOWN_GRACE_S)
        self._conn.close()


_started: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """At the driver's exit, kill the children no shutdown stopped (a driver that raised before it)."""
    for process in list(_started):
        if process.poll() is None:
            process.kill()


class _Handle:
    def __init__(self, child: RankChild):
        self._child = child

    def __getattr__(self, method: str) -> _Call:
        return _Call(self._child, method)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the driver, ``parent``, dies (Linux; elsewhere it ends when its pipe closes, or in
    its next collective). PR_SET_PDEATHSIG fires when the driver's *thread* that started it exits: rlmega starts
    the ranks from the driver's main thread."""
    from rlmega.launch.guardian import signal_when_parent_dies

    signal_when_parent_dies(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _serve(rank: int, world_size: int, conn: Connection) -> None:
    """A child's life: a ``RankProcess`` serving the driver's calls until ``shutdown`` or the pipe closes."""
    from rlmega.trainer.training_group import RankProcess

    process = RankProcess(rank, world_size)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        method, args, kwargs = _CallUnpickler(io.BytesIO(data)).load()
        try:
            result = getattr(process, method)(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - reported to the driver, which decides
            traceback.print_exc()
            conn.send(("raised", type(error).__name__, str(error)))
            os._exit(1)  # rank 0 may be blocked in a collective with this rank: make it fail now
        conn.send(("ok", result))
        if method == "shutdown":
            return


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[4]))
    _serve(int(sys.argv[1]), int(sys.argv[2]), Connection(int(sys.argv[3])))

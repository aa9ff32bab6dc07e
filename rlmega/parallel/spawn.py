"""Run a function on N ranks in new processes, with a hard timeout.

    results = run_on_ranks(body, world_size=4, timeout_s=120, args=(layout,))

``body(rank, world_size, *args)`` runs in a new process with ``torch.distributed`` initialised on
``rlmega.parallel.layout.default_backend()`` (gloo; where the rank sees a GPU, NCCL for CUDA tensors
beside it) and, without CUDA, the CPU platform enabled; its return values come back as a list indexed by rank.
Without a GPU, ranks are forked from a server process that has imported torch and Megatron-Core once
(``rank_preload``; multiprocessing's ``forkserver``), with the caller's environment, working
directory, stdout and stderr, as a spawned process would have them. Where the caller sees a GPU they are
spawned: those imports ask torch about CUDA, and a process forked after that cannot use CUDA.
``start_method="spawn"`` always starts each from scratch (what a memory measurement wants).
The first rank that raises or dies fails the whole run with that rank's traceback; every other
rank is then killed, so no process outlives the call. ``RankFailure.cause`` is the one line to show a
person: the exception's message, without the traceback or the rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
import warnings
from multiprocessing import reduction
from typing import Any, Callable, Optional, Sequence

_POLL_S = 0.05
_KILL_GRACE_S = 5.0
_SETTLE_S = 1.0


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time."""

    def __init__(self, rank: int, detail: str, error_type: Optional[str] = None, message: Optional[str] = None,
                 bad_input: bool = False):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail
        self.error_type = error_type
        """The exception's class name, when the rank raised."""
        self.message = message
        """``str()`` of the exception, when the rank raised."""
        self.bad_input = bad_input
        """The exception says the input cannot work (a ``ValueError``, as rlmega's ``UserError``,
        ``LayoutError``, ``CheckpointError`` and ``UnsupportedModelError`` are), not that the code failed."""

    @property
    def cause(self) -> str:
        """One line: a bad input's message as it is; any other exception as ``Type: message``; a
        rank that died or hung as the harness saw it."""
        if self.error_type is None:
            return " ".join(self.detail.split())
        message = " ".join((self.message or "").split())
        if self.bad_input and message:
            return message
        return f"{self.error_type}: {message}" if message else self.error_type


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _CallerStdio:
    """The caller's stdout and stderr at the moment a rank starts, sent to it as file descriptors: a forked
    rank would otherwise write where the fork server's were when it started (a closed pytest capture)."""

    def __reduce__(self):
        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(stdout, stderr) -> None:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    for fd, inherited in ((1, stdout), (2, stderr)):
        received = inherited.detach()
        os.dup2(received, fd)
        os.close(received)


def _rank_main(body, rank, world_size, port, collective_timeout_s, args, results, quiet, environment=None,
               stdio=None):
    # ``stdio``: nothing by now; unpickling it (``_CallerStdio``) has already pointed this rank's stdout and stderr
    # at the caller's.
    os.setpgrp()  # own process group: stopping the rank also stops whatever it started
    if environment is not None:  # a forked rank has the fork server's environment: take the caller's
        os.environ.clear()
        os.environ.update(environment)
    if quiet:  # N ranks would each print the libraries' warnings in front of the one error that matters
        warnings.simplefilter("ignore")
        logging.getLogger().setLevel(logging.ERROR)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    try:
        import torch
        import torch.distributed as dist

        from rlmega.parallel import cpu_platform
        from rlmega.parallel.gloo_interface import bind_gloo_where_ranks_meet
        from rlmega.parallel.layout import default_backend

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        cpu_platform.enable()
        bind_gloo_where_ranks_meet([os.environ["MASTER_ADDR"]])
        dist.init_process_group(
            default_backend(),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        # Plain pickle copies tensors by value; torch's shared-memory reductions would die with
        # the rank's process.
        value = pickle.dumps(body(rank, world_size, *args))
        results.put((rank, True, value))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, False, (traceback.format_exc(), type(error).__name__, str(error), isinstance(error, ValueError))))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # the result is already delivered; teardown noise must not mask it
        pass


def _signal_group(proc: mp.Process, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(processes: Sequence[mp.Process]) -> None:
    """Stop every rank and its children (each rank leads its own process group)."""
    for proc in processes:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        _signal_group(proc, signal.SIGKILL)
        proc.join()


@contextlib.contextmanager
def _gpus_hidden(hide: bool):
    """``CUDA_VISIBLE_DEVICES`` empty while the ranks start (they take this process's environment), if ``hide``."""
    if not hide:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def _context(start_method: str):
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["rlmega.parallel.rank_preload"])  # no effect once the server runs
    return ctx


def run_on_ranks(
    body: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float = 120.0,
    args: tuple = (),
    quiet: bool = False,
    start_method: Optional[str] = None,
    cpu_only: bool = False,
) -> list:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` new ranks.

    ``body`` and ``args`` must be picklable (a module-level function). Returns the per-rank return
    values. Raises RankFailure naming the first rank that raised, exited without a result, or was
    still running when ``timeout_s`` ran out. ``quiet``: the ranks print no warnings and no log
    records below ERROR (command-line tools, whose user should see only the cause of a failure).
    ``start_method``: ``"forkserver"`` (ranks start with the heavy imports done) or ``"spawn"``; None picks
    ``"spawn"`` where this process sees a GPU, else ``"forkserver"``. ``cpu_only``: the ranks see no GPU and
    run on the CPU over gloo, also on a GPU node (a conversion, ``rlmega smoke``).
    """
    with _gpus_hidden(cpu_only):
        if start_method is None:
            import torch

            start_method = "spawn" if torch.cuda.is_available() else "forkserver"
        ctx = _context(start_method)
        forked = start_method == "forkserver"
        results = ctx.Queue()
        port = free_port()
        # Collectives time out a little before the harness does, so a hung rank reports itself.
        collective_timeout_s = max(5.0, timeout_s * 0.8)
        processes = [
            ctx.Process(
                target=_rank_main,
                args=(body, rank, world_size, port, collective_timeout_s, args, results, quiet,
                      dict(os.environ) if forked else None, _CallerStdio() if forked else None),
                name=f"rank{rank}",
                daemon=False,  # ranks may start helper processes (dist_checkpointing does)
            )
            for rank in range(world_size)
        ]
        for proc in processes:
            proc.start()
    values: dict[int, Any] = {}
    errors: dict[int, tuple] = {}  # in arrival order: (traceback, type name, message, bad input)
    dead: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    settle_deadline = None

    def drain():
        while not results.empty():
            rank, ok, payload = results.get()
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload

    try:
        while len(values) < world_size:
            drain()
            exited = [r for r, p in enumerate(processes) if p.exitcode is not None]
            drain()  # a rank's message is written before it exits: read it before calling it dead
            for rank in exited:
                if rank not in values and rank not in errors:
                    dead.setdefault(rank, processes[rank].exitcode)
            if errors or dead:
                # Peers of a failed rank fail too, a moment later; wait briefly to name the cause.
                settle_deadline = settle_deadline or time.monotonic() + _SETTLE_S
                if time.monotonic() >= settle_deadline:
                    break
            elif time.monotonic() > deadline:
                pending = sorted(set(range(world_size)) - set(values))
                raise RankFailure(
                    pending[0], f"still running after {timeout_s:.0f}s (ranks {pending} unfinished)"
                )
            time.sleep(_POLL_S)
        if dead:
            rank = min(dead)
            raise RankFailure(rank, f"process exited with code {dead[rank]} before returning a result")
        if errors:
            rank = next(iter(errors))
            detail, error_type, message, bad_input = errors[rank]
            raise RankFailure(rank, detail, error_type, message, bad_input)
    finally:
        _stop(processes)
    return [values[rank] for rank in range(world_size)]

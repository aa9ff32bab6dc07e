"""Worker processes write to the run's log files, not to the console.

Every rank and engine actor redirects its stdout and stderr (file descriptors 1 and 2, so library
warnings, C++ messages and progress bars all go) to ``run_dir/logs/workers/<name>.log`` as the first
thing it does; Ray then has nothing of theirs to forward, and the console keeps rlmega's own lines.
What a worker raises still reaches the driver as an exception; a worker that dies is reported on
one line naming it and its log (``rlmega.trainer.remote.WorkerFailure``).

The driver starts actors with ``actor_env(run_dir, name)`` among their environment variables and
``logged(cls)`` as their class (or calls ``redirect_output()`` at the top of ``__init__``). A run in one
process keeps its rank's and engine's output in ``logs/workers/in-process.log`` with ``output_to``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Optional

LOG_ENV = "RLMEGA_WORKER_LOG"
_known: dict[str, str] = {}
"""Worker name -> its log file, for the processes this driver started (error messages name them)."""


def log_path(run_dir: str | Path, name: str) -> Path:
    """``run_dir/logs/workers/<name>.log``, the name in lower case with words joined by '-'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "worker"
    return Path(run_dir) / "logs" / "workers" / f"{slug}.log"


def actor_env(run_dir: Optional[str | Path], name: str) -> dict[str, str]:
    """The environment variable that sends the actor ``name``'s output to its log (none without a run dir)."""
    if not run_dir:
        return {}
    path = log_path(run_dir, name)
    _known[name] = str(path)
    return {LOG_ENV: str(path)}


def log_of(name: str) -> Optional[str]:
    """The log file of the worker this driver started as ``name``, if any."""
    return _known.get(name)


def redirect_output() -> None:
    """Send this process's stdout and stderr to the file ``$RLMEGA_WORKER_LOG`` names (appending);
    nothing when it is unset."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering, so the log is current when the process dies.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(line_buffering=True)
            except (ValueError, OSError):
                pass


@contextlib.contextmanager
def output_to(log) -> None:
    """The block's Python-level output (prints, warnings, progress bars) into the open file ``log``: for worker
    code that runs in the driver's own process (``rlmega.trainer.in_process``), whose console must stay the
    driver's. File descriptors stay as they are, so what the driver shows meanwhile (its progress bar holds
    the console's stream itself) still reaches the terminal."""
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def logged(cls: type) -> type:
    """``cls`` whose instances redirect their process's output (``redirect_output``) before ``__init__``."""

    def __init__(self, *args, **kwargs):
        redirect_output()
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def tail(path: str | Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])

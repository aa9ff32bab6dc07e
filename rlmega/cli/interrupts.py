"""Ctrl-C ends every ``rlmega`` command, within seconds and on one line.

Python turns SIGINT into KeyboardInterrupt in the main thread, but only between two Python instructions: a main
thread blocked in a library's native code (a thread pool waiting for threads that never started, a collective
waiting for a peer that stopped) never gets there, and the command would ignore Ctrl-C. The C-level signal handler
writes the signal's number to the wake-up file descriptor (``signal.set_wakeup_fd``) whatever the main thread does;
a thread reading it gives the main thread ``GRACE_S`` seconds to take the interrupt (it then unwinds and cleans up
as usual, however long that takes: a second Ctrl-C interrupts the clean-up the same way) and otherwise ends the
process itself. The processes a run starts die with it (``rlmega.trainer.local_ranks``, ``rlmega.launch.guardian``).
The watch is Python code, so it needs the interpreter lock, which native code that blocks lets go of (a wait in a
C extension that kept it would keep the watch out too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

GRACE_S = 5.0
"""How long the main thread has to take a Ctrl-C before the process is ended without it."""
INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT, what shells report for a command that Ctrl-C ended."""


class _Watch:
    """The state of one command's watch: its pipe, and the interrupts its main thread took."""

    def __init__(self, command: str):
        self.command = command
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # the C handler must never block on a full pipe
        self.taken = 0

    def take(self, signum, frame) -> None:
        """The SIGINT handler of the main thread: count the interrupt, raise it."""
        self.taken += 1
        raise KeyboardInterrupt

    def watch(self) -> None:
        """Read the wake-up descriptor until the command ends (EOF); end the process when an interrupt is not taken."""
        received = 0
        with os.fdopen(self.read_fd, "rb", buffering=0) as wakeups:
            while True:
                numbers = wakeups.read(64)
                if not numbers:
                    return
                received += numbers.count(signal.SIGINT)
                deadline = time.monotonic() + GRACE_S
                while self.taken < received and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.taken < received and signal.getsignal(signal.SIGINT) == self.take:
                    os.write(2, f"rlmega {self.command}: interrupted\n".encode())
                    os._exit(INTERRUPTED_EXIT_CODE)


_active: Optional[_Watch] = None


def _forgotten_in_child() -> None:
    """A forked child is not the command: its interrupts are its own (the pipe would report them to our watch)."""
    global _active
    if _active is None:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in (_active.read_fd, _active.write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)
    _active = None


os.register_at_fork(after_in_child=_forgotten_in_child)


@contextlib.contextmanager
def interrupts_end(command: str) -> Iterator[None]:
    """Within the block, Ctrl-C raises KeyboardInterrupt in the main thread as usual, and ends the process (exit code
    130, ``rlmega <command>: interrupted`` on stderr) if the main thread does not take it within ``GRACE_S``.
    Nothing changes outside the main thread, under another SIGINT handler, or where a wake-up descriptor is set."""
    global _active
    if (threading.current_thread() is not threading.main_thread() or _active is not None
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    watch = _Watch(command)
    previous_fd = signal.set_wakeup_fd(watch.write_fd, warn_on_full_buffer=False)
    if previous_fd != -1:  # someone else's (an event loop's): leave it theirs
        signal.set_wakeup_fd(previous_fd)
        os.close(watch.read_fd)
        os.close(watch.write_fd)
        yield
        return
    signal.signal(signal.SIGINT, watch.take)
    _active = watch
    watcher = threading.Thread(target=watch.watch, name="rlmega-interrupt-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        _active = None
        current_fd = signal.set_wakeup_fd(-1)
        if current_fd != watch.write_fd:  # set by someone else meanwhile: theirs to keep
            signal.set_wakeup_fd(current_fd)
        if signal.getsignal(signal.SIGINT) == watch.take:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(watch.write_fd)  # the watch reads EOF and ends
        watcher.join(timeout=GRACE_S + 1)


def print_interrupted(command: str) -> int:
    """The one line a command that Ctrl-C ended prints; its exit code."""
    print(f"rlmega {command}: interrupted", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE

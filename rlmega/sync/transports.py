"""How a weight update travels from the trainer's sending rank into rollout engines.

A ``BucketTransport`` is the sender's side of one bucketed update (on the rank that gathered the model).
Its life: ``open(engines, version)`` starts each engine receiving (in the engine's own process),
``send(bucket)`` ships one bucket of ``(hf_name, tensor)``, ``finish()`` ends the stream and waits until
every engine has committed the version, ``abort(reason)`` tells the receivers the update failed, and
``close()`` ends the update (always called); ``release()`` lets go of what it kept for the next one. ``stream_update`` runs that life around an iterable of buckets.

``send`` returns while its bucket is still in transit, so the caller builds bucket n+1 (TP gather,
packing) while bucket n is moved and copied in; it blocks before a third bucket would be in flight.

The transports (``TRANSPORTS``):

  ``in_process``     the engine object lives in this process: a background thread feeds its
                     ``update_weights`` the tensors themselves.
  ``object_store``   the same hand-off to a ``RemoteEngine``, whose ``update_weights`` ships the
                     buckets through Ray's object store (works across nodes; the slowest).
  ``shared_memory``  same host: buckets are written into a reusable two-slot region (/dev/shm on
                     CPU, CUDA IPC on GPU); the engine's process gets only metadata and copies from views.
  ``broadcast``      a torch.distributed group of its own between the sender and the engine
                     processes (gloo on CPU, NCCL on GPU): one flat tensor per bucket, to any number of engines.

The receiving side of ``shared_memory`` and ``broadcast`` is a small picklable iterable: it is sent
into the engine's process and handed to the engine's ``update_weights`` there, which consumes it
like any other stream and commits the version only when it ends cleanly.

The transports by name, ``auto`` and the transports kept for later updates are in ``rlmega.sync.registry``;
``rlmega.sync.gathered.GatheredTransport`` streams the bridge's export through one of them.
"""

from __future__ import annotations

import threading
import traceback
from concurrent.futures import Future
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from rlmega.sync.buckets import NamedTensors
from rlmega.sync.control import Watch
from rlmega.sync.errors import TransportError

DEFAULT_TIMEOUT_S = 600.0


@runtime_checkable
class EngineProcess(Protocol):
    """An engine in a process of its own (``rlmega.trainer.engine_actor.RemoteEngine``), as the transports see it;
    an engine object in this process is any ``RolloutEngine``. Its ``key`` attribute, if any, tells engines apart
    (a Ray actor id): transports are kept per set of engines by it."""

    def start_update(self, named_tensors: Iterable, version: int) -> Future:
        """``update_weights(named_tensors, version)`` in the engine's process, in the background."""

    def is_local(self) -> bool:
        """Whether the engine's process runs on this host."""


class BucketTransport(Protocol):
    """The sender's side of one bucketed weight update; see the module docstring."""

    name: str

    def open(self, engines: Sequence, version: int) -> None: ...

    def send(self, bucket: NamedTensors) -> None: ...

    def finish(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    def close(self) -> None:
        """The end of an update (always called); what the transport keeps for the next is its own
        choice, except after a failed update, which leaves nothing behind."""

    def release(self) -> None:
        """Let go of what ``close`` kept for the next update (a region, a group): no more updates follow."""


def stream_update(transport: BucketTransport, engines: Sequence, buckets: Iterable[NamedTensors], version: int) -> None:
    """Send every bucket of ``buckets`` into ``engines`` as ``version``; returns once they committed it."""
    try:
        transport.open(engines, version)
        for bucket in buckets:
            transport.send(bucket)
        transport.finish()
    except BaseException as error:
        transport.abort(f"{type(error).__name__}: {error}")
        raise
    finally:
        transport.close()


def start_update(engine, named_tensors: Iterable, version: int) -> Future:
    """Run ``engine.update_weights(named_tensors, version)`` in the engine's process, in the
    background: an ``EngineProcess`` starts it there (``RemoteEngine``: a Ray call, ``named_tensors`` pickled
    into the actor); an engine object here runs it on a daemon thread."""
    if isinstance(engine, EngineProcess):
        return engine.start_update(named_tensors, version)
    return in_thread(engine.update_weights, named_tensors, version)


def in_thread(function: Callable, *args) -> Future:
    """``function(*args)`` on a daemon thread (one that never keeps the interpreter alive)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - delivered to whoever waits on the future
            # The stored error must not keep the failed call's locals alive: a half-consumed stream
            # is closed now (so a receiver releases its buffers and group), not when the error dies.
            traceback.clear_frames(error.__traceback__)
            future.set_exception(error)

    threading.Thread(target=run, name="rlmega-weight-receiver", daemon=True).start()
    return future


class _HandOff:
    """One bucket at a time from the sending thread to the engine's thread. The sender puts a bucket
    only when the engine is ``idle`` (has consumed the previous one), so one bucket is being copied
    in while the sender builds the next. Each side wakes the other at once (a condition, not polling)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._bucket: Optional[NamedTensors] = None
        self._busy = False  # the engine is consuming a bucket
        self._end: Optional[str] = None  # "end", or the reason of an abort

    def _idle(self) -> bool:
        return self._bucket is None and not self._busy

    def idle(self) -> bool:
        """The engine has taken every bucket handed over (if it stops taking them, its update call
        ends, and the sender's ``Watch`` reports that)."""
        with self._changed:
            return self._idle()

    def wait_idle(self, seconds: float) -> None:
        """Return once ``idle()``, or after ``seconds``."""
        with self._changed:
            self._changed.wait_for(self._idle, seconds)

    def put(self, bucket: NamedTensors) -> None:
        with self._changed:
            self._bucket = bucket
            self._changed.notify_all()

    def close(self, end: str) -> None:
        with self._changed:
            self._end = end
            self._changed.notify_all()

    def __iter__(self):
        while True:
            with self._changed:  # the sender always ends the stream (close), also when it fails
                self._changed.wait_for(lambda: self._bucket is not None or self._end is not None)
                bucket, self._bucket = self._bucket, None
                end = self._end
                self._busy = bucket is not None
            if bucket is None:
                if end != "end":
                    raise TransportError(f"the sender aborted the update: {end}")
                return
            yield from bucket
            with self._changed:
                self._busy = False
                self._changed.notify_all()


class HandOffTransport:
    """``in_process`` and ``object_store``: each engine's own ``update_weights`` on a background
    thread of this process, fed bucket by bucket. Tensors are handed over as they are (no copy);
    every engine copies them in, and the next bucket follows once all have taken this one."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "in_process"):
        self.name = name
        self.timeout_s = timeout_s
        self._handoffs: list[_HandOff] = []
        self._watch: Optional[Watch] = None

    def open(self, engines: Sequence, version: int) -> None:
        self._handoffs = [_HandOff() for _ in engines]
        self._watch = Watch([in_thread(engine.update_weights, handoff, version)
                             for engine, handoff in zip(engines, self._handoffs)], self.timeout_s)

    def send(self, bucket: NamedTensors) -> None:
        self._watch.until(self._idle, "the engines to take the previous bucket", block=self._wait_idle)
        for handoff in self._handoffs:
            handoff.put(bucket)

    def finish(self) -> None:
        self._watch.until(self._idle, "the engines to take the last bucket", block=self._wait_idle)
        for handoff in self._handoffs:
            handoff.close("end")
        self._watch.finish()

    def abort(self, reason: str) -> None:
        for handoff in self._handoffs:
            handoff.close(reason)
        if self._watch is not None:
            self._watch.settle()

    def close(self) -> None:
        self._handoffs, self._watch = [], None

    def release(self) -> None:
        pass  # keeps nothing between updates

    def _idle(self) -> bool:
        return all(handoff.idle() for handoff in self._handoffs)

    def _wait_idle(self, seconds: float) -> None:
        for handoff in self._handoffs:  # ``until`` checks them all again, and the peers, after each wait
            handoff.wait_idle(seconds)

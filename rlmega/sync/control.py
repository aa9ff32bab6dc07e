"""The control plane of the cross-process transports: a ``torch.distributed.TCPStore`` hosted by
the sender, carrying small signed messages (bucket metadata, acknowledgements, failures).

Messages are pickled (they hold dtypes and, for CUDA IPC, memory handles) and signed with a key
that only the sender and the receivers it created know (the key travels inside the receiver
object, through the channel that starts the engine's side, e.g. a Ray call), so another process
that reaches the port cannot inject objects.

Keys: ``bucket/{i}`` (sender -> receivers: a bucket, the end of the stream, or an abort),
``ack/{rank}/{i}`` (a receiver has copied bucket i), ``done/{rank}`` (a receiver reached the end
and handed it to its engine), ``fail`` (a receiver failed: which one, and why). A channel that
serves update after update (``shared_memory`` and ``broadcast`` keep theirs) puts each update's keys
under a prefix of their own (``"{update}/"``), so nothing of one update is read in another.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import pickle
import secrets
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from rlmega.sync.errors import TransportError

_DIGEST_BYTES = 32
POLL_MIN_S = 0.0002
POLL_MAX_S = 0.005
BLOCK_S = 0.05  # a blocking wait returns at once when its keys or futures are ready; peers are checked this often
_ENGINE_ERROR_GRACE_S = 2.0
_SETTLE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Address:
    """Where receivers find the sender's store, and the key that signs messages."""

    host: str
    port: int
    key: bytes
    timeout_s: float


class Channel:
    """Signed messages over a TCPStore; one per process."""

    def __init__(self, store: dist.Store, key: bytes):
        self.store = store
        self._key = key

    @classmethod
    def serve(cls, host: str, timeout_s: float) -> tuple["Channel", Address]:
        """Start a store on a free port of ``host``; returns the channel and the receivers' address."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        key = secrets.token_bytes(32)
        return cls(store, key), Address(host, store.port, key, timeout_s)

    @classmethod
    def connect(cls, address: Address) -> "Channel":
        timeout = datetime.timedelta(seconds=address.timeout_s)
        store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
        return cls(store, address.key)

    def post(self, name: str, message: Any) -> None:
        data = pickle.dumps(message)
        self.store.set(name, hmac.new(self._key, data, hashlib.sha256).digest() + data)

    def get(self, name: str) -> Any:
        """The message under ``name``, waiting for it up to the store's timeout."""
        return self._open(name, self.store.get(name))

    def forget(self, *names: str) -> None:
        for name in names:
            self.store.delete_key(name)

    def peek(self, name: str) -> Any:
        """The message under ``name`` if there is one (None otherwise), without waiting."""
        if not self.store.check([name]):
            return None
        return self._open(name, self.store.get(name))

    def has(self, names: Sequence[str]) -> bool:
        return self.store.check(list(names))

    def wait_for(self, names: Sequence[str], seconds: float) -> None:
        """Return once every message in ``names`` is there, or after ``seconds`` (whichever is first)."""
        try:
            self.store.wait(list(names), datetime.timedelta(seconds=seconds))
        except dist.DistStoreError:  # not there yet: the caller checks its peers and waits again
            pass

    def _open(self, name: str, signed: bytes) -> Any:
        digest, data = signed[:_DIGEST_BYTES], signed[_DIGEST_BYTES:]
        if not hmac.compare_digest(digest, hmac.new(self._key, data, hashlib.sha256).digest()):
            raise TransportError(f"control message {name!r} is not signed by this transfer's sender; refusing it")
        return pickle.loads(data)


class Watch:
    """What a sender waits on besides its own transfers: the engines' update calls (a Future each,
    failing if the engine raised or died) and the receivers' failure reports. Every wait is polled
    against both and bounded by ``timeout_s``, so a dead peer turns into an error, never a hang."""

    def __init__(self, futures: Sequence[Future], timeout_s: float, channel: Optional[Channel] = None,
                 prefix: str = ""):
        self.futures = list(futures)
        self.timeout_s = timeout_s
        self._channel = channel
        self._prefix = prefix  # of the update's keys

    def check(self, finishing: bool = False) -> None:
        for index, future in enumerate(self.futures):
            if not future.done():
                continue
            error = future.exception()
            if error is not None:
                raise TransportError(f"engine {index} failed while receiving weights: {error!r}",
                                     engine_error=error) from error
            if not finishing:
                raise TransportError(f"engine {index} finished its update before the sender sent the end of the stream")
        if self._channel is not None:
            reason = self._channel.peek(f"{self._prefix}fail")
            if reason is not None:
                # The engine's own error, if its call fails too, says more than the receiver's report.
                wait(self.futures, timeout=_ENGINE_ERROR_GRACE_S, return_when=FIRST_EXCEPTION)
                if any(f.done() and f.exception() is not None for f in self.futures):
                    self.check(finishing=True)
                raise TransportError(f"a receiver failed: {reason}")

    def until(self, ready: Callable[[], bool], what: str, finishing: bool = False,
              block: Optional[Callable[[float], object]] = None) -> None:
        """Return once ``ready()``; raise TransportError if a peer fails or ``timeout_s`` passes.
        ``block(seconds)``: a wait on what ``ready`` reads that returns as soon as it is ready (so the
        sender wakes at once, not at the next poll); without it, polls with growing sleeps."""
        deadline = time.monotonic() + self.timeout_s
        pause = POLL_MIN_S
        while not ready():
            self.check(finishing)
            if time.monotonic() > deadline:
                raise TransportError(f"timed out after {self.timeout_s:g} s waiting for {what}")
            if block is not None:
                block(min(BLOCK_S, max(0.0, deadline - time.monotonic())))
            else:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)

    def settle(self) -> None:
        """After an abort: give the engines' update calls a moment to end, so an engine in this
        process is no longer writing when the caller sees the error."""
        wait(self.futures, timeout=min(self.timeout_s, _SETTLE_S))

    def finish(self) -> None:
        """Wait for every engine's update call to return (the version is committed then)."""
        self.until(lambda: all(f.done() for f in self.futures), "the engines to commit the update", finishing=True,
                   block=lambda seconds: wait(self.futures, timeout=seconds))
        self.check(finishing=True)


def end_stream(channel: Channel, watch: Watch, index: int, ranks: Sequence[int], prefix: str) -> None:
    """Sender: announce the end as ``{prefix}bucket/{index}``, then wait until every receiver in ``ranks``
    has reached it and every engine has committed the update."""
    channel.post(f"{prefix}bucket/{index}", ("end",))
    done = [f"{prefix}done/{rank}" for rank in ranks]
    watch.until(lambda: channel.has(done), "the receivers to reach the end of the stream", finishing=True,
                block=lambda seconds: channel.wait_for(done, seconds))
    watch.finish()


def abort_stream(channel: Optional[Channel], watch: Watch, index: int, reason: str, prefix: str) -> None:
    """Sender, best effort: tell the receivers the update is off, and let the engines' calls end."""
    if channel is None:
        return
    try:
        channel.post(f"{prefix}bucket/{index}", ("abort", reason))
    except Exception:  # the store may be unusable; receivers then fail on their own
        pass
    watch.settle()


def report_failure(channel: Channel, rank: int, error: BaseException, prefix: str) -> None:
    """Best effort: tell the sender why this receiver stopped."""
    try:
        channel.post(f"{prefix}fail", f"receiver {rank}: {type(error).__name__}: {error}")
    except Exception:  # the sender may be gone already; the original error is what matters
        pass


def receive_stream(channel: Channel, rank: int, take_bucket: Callable[[Channel, int, tuple], Iterator],
                   prefix: str) -> Iterator:
    """Receiver ``rank``'s side of one update over its connection to the sender's store: reads
    ``{prefix}bucket/{i}`` messages in order and lets ``take_bucket(channel, i, payload)`` yield each
    bucket's ``(hf_name, tensor)`` pairs.

    Ends cleanly only at the sender's end of stream (then posts ``done/{rank}``); raises
    ``TransportError`` if the sender aborts. Any failure, including the engine dropping the stream
    before its end, is reported to the sender before it propagates.
    """
    finished = False
    try:
        index = 0
        while True:
            message = channel.get(f"{prefix}bucket/{index}")
            if message[0] == "end":
                finished = True
                channel.post(f"{prefix}done/{rank}", None)
                return
            if message[0] == "abort":
                raise TransportError(f"the sender aborted the update: {message[1]}")
            yield from take_bucket(channel, index, message[1:])
            index += 1
    except GeneratorExit:
        if not finished:
            report_failure(channel, rank, TransportError("the engine stopped consuming the stream before its end"),
                           prefix)
        raise
    except BaseException as error:
        report_failure(channel, rank, error, prefix)
        raise


def forget_update(channel: Channel, prefix: str, ranks: Sequence[int], num_buckets: int, first: int = 0) -> None:
    """Sender, after a finished update on a kept store: delete every key it left (buckets from ``first``
    on, the end, their acknowledgements, done), so the store holds nothing between updates."""
    channel.forget(*[f"{prefix}bucket/{i}" for i in range(first, num_buckets + 1)],
                   *[f"{prefix}ack/{r}/{i}" for r in ranks for i in range(first, num_buckets)],
                   *[f"{prefix}done/{r}" for r in ranks])


@dataclasses.dataclass
class Kept:
    """What a receiver keeps in the engine's process from one update of a sender to the next: its
    connection, and its transport's own state (a mapped region; a process group and its buffer)."""

    address: Address
    channel: Channel
    state: dict = dataclasses.field(default_factory=dict)


# Receiver rank -> what it keeps of its sender. One sender per rank and process: a receiver of another
# sender replaces it (its sender made a new transport), so a process never holds more than one region
# or group per rank.
_KEPT: dict[int, Kept] = {}


def receive_kept(address: Address, rank: int, update: int,
                 take_bucket: Callable[[Kept, Channel, int, tuple], Iterator]) -> Iterator:
    """``receive_stream`` of update number ``update`` of a sender that keeps its store between updates,
    over the connection this process kept from the sender's last update (made on the first).
    ``take_bucket(kept, channel, index, payload)`` may keep state in ``kept.state``. A failed update
    drops what was kept: the next one connects afresh."""
    try:
        kept = _KEPT.get(rank)
        if kept is None or kept.address != address:
            _KEPT.pop(rank, None)  # let go of the old sender's region or group before taking the new one's
            kept = _KEPT[rank] = Kept(address, Channel.connect(address))
        yield from receive_stream(kept.channel, rank,
                                  lambda channel, index, payload: take_bucket(kept, channel, index, payload), f"{update}/")
    except BaseException:
        if _KEPT.get(rank) is not None and _KEPT[rank].address == address:
            del _KEPT[rank]
        raise

"""What the cross-process bucket transports (``shared_memory``, ``broadcast``) share on the sender's side: the
control channel (a store the receivers reach, set up on the first update or after a failure and kept for the
next), the update's numbered key prefix, the ``Watch`` on the engines' update calls, and the end of an update."""

from __future__ import annotations

from typing import Optional, Sequence

from rlmega.sync.control import Address, Channel, Watch, abort_stream
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, start_update


class StoreSender:
    """The sender's control state; a transport adds its data path (``listen``'s receivers, ``send``, ``finish``,
    ``release``)."""

    def __init__(self, *, bucket_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S, host: str = "127.0.0.1"):
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self._channel: Optional[Channel] = None
        self._address: Optional[Address] = None
        self._watch: Optional[Watch] = None
        self._num_receivers = 0
        self._update = 0  # updates started; each one's control keys are under "{update}/"
        self._sent = 0  # buckets sent in this update
        self._failed = False

    @property
    def _prefix(self) -> str:
        return f"{self._update}/"

    def _start_update(self, num_receivers: int) -> None:
        """A new update into ``num_receivers`` receivers, on the kept control channel (a new one on the first
        update, after a failure, or for another number of receivers)."""
        if num_receivers < 1:
            raise ValueError(f"need at least one receiver, got {num_receivers}")
        if self._channel is None or num_receivers != self._num_receivers:
            self.release()
            self._channel, self._address = Channel.serve(self.host, self.timeout_s)
            self._num_receivers = num_receivers
        self._update += 1
        self._sent, self._failed = 0, False
        self._watch = Watch([], self.timeout_s, self._channel, self._prefix)

    def listen(self, num_receivers: int) -> list:
        raise NotImplementedError

    def open(self, engines: Sequence, version: int) -> None:
        receivers = self.listen(len(engines))
        self._watch.futures = [start_update(engine, receiver, version) for engine, receiver in zip(engines, receivers)]

    def abort(self, reason: str) -> None:
        self._failed = True
        abort_stream(self._channel, self._watch, self._sent, reason, self._prefix)

    def close(self) -> None:
        """End of an update: a failed one releases what the transport keeps (a receiver may still hold it
        half-read); a complete one keeps it for the next."""
        if self._failed:
            self.release()

    def release(self) -> None:
        raise NotImplementedError

"""The weight-sync transports by name (``TRANSPORTS``), ``auto``'s choice among them (``make_transport``), and
the transports kept per set of engines in this process (``kept_transport``): a transport object serves any
number of updates, so ``shared_memory`` and ``broadcast`` set up their store, region or group once, not at
every sync."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from rlmega.sync.broadcast import BroadcastTransport
from rlmega.sync.shared_memory import SharedMemoryTransport
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, BucketTransport, EngineProcess, HandOffTransport


def _hand_off(name: str) -> Callable[..., BucketTransport]:
    return lambda *, bucket_bytes, timeout_s: HandOffTransport(name=name, timeout_s=timeout_s)


# name -> factory(bucket_bytes=, timeout_s=), with each transport's defaults for everything else. (vLLM's own
# sharded_rdt is not a bucket transport: see rlmega.sync.config.)
TRANSPORTS: dict[str, Callable[..., BucketTransport]] = {
    "in_process": _hand_off("in_process"),
    "object_store": _hand_off("object_store"),
    "shared_memory": SharedMemoryTransport,
    "broadcast": BroadcastTransport,
}


def make_transport(transport: "str | BucketTransport", engines: Sequence, *, bucket_bytes: int,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> BucketTransport:
    """A transport by name (``TRANSPORTS``, or ``"auto"``), or ``transport`` itself if it is one.

    ``auto``: ``in_process`` for an engine object in this process; for engines in other processes,
    ``shared_memory`` when they all run on this host, else ``object_store`` (``broadcast`` needs an
    address the engines reach, so it is chosen by passing a configured ``BroadcastTransport``).
    """
    if not isinstance(transport, str):
        return transport
    if transport == "auto":
        remote = [engine for engine in engines if isinstance(engine, EngineProcess)]
        if not remote:
            transport = "in_process"
        else:
            transport = "shared_memory" if all(engine.is_local() for engine in remote) else "object_store"
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {sorted(TRANSPORTS)} or 'auto'")
    return TRANSPORTS[transport](bucket_bytes=bucket_bytes, timeout_s=timeout_s)


_KEPT: "OrderedDict[tuple, BucketTransport]" = OrderedDict()
_MAX_KEPT = 8


def kept_transport(transport: str, engines: Sequence, *, bucket_bytes: int,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> BucketTransport:
    """``make_transport(transport, engines, ...)``, made once per set of engines (and settings) in this
    process and reused for every later update into them. Engines are told apart by their ``key`` (an
    engine actor's id: a rank gets new ``RemoteEngine`` handles with every call); with an engine that has
    none, a new transport is made for each update (and nothing of it is kept)."""
    keys = tuple(getattr(engine, "key", None) for engine in engines)
    if not keys or None in keys:
        return make_transport(transport, engines, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    key = (transport, bucket_bytes, timeout_s, keys)
    kept = _KEPT.pop(key, None) or make_transport(transport, engines, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    _KEPT[key] = kept
    while len(_KEPT) > _MAX_KEPT:
        _, dropped = _KEPT.popitem(last=False)
        dropped.release()
    return kept

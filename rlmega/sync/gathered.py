"""``GatheredTransport``: the bridge's export gathered to the engines' rank, which streams it bucket by bucket through
a bucket transport (``rlmega.sync.transports``), bucket n shipped while bucket n+1 is built."""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Optional, Sequence

from rlmega.bridge import DEFAULT_BUCKET_BYTES
from rlmega.bridge.export import export_hf_buckets
from rlmega.bridge.fp8 import quantized_buckets
from rlmega.models.spec import ModelSpec
from rlmega.sync.buckets import NamedTensors, nbytes_of
from rlmega.sync.errors import WeightSyncError
from rlmega.sync.stats import SyncStats
from rlmega.sync.transports import BucketTransport, stream_update


def _counted(buckets: Iterable[NamedTensors], totals: dict) -> Iterator[NamedTensors]:
    for bucket in buckets:
        totals["tensors"] += len(bucket)
        totals["bytes"] += nbytes_of(bucket)
        yield bucket


class GatheredTransport:
    """The bridge's export, gathered to ``engine_rank``, which streams it bucket by bucket into its ``engines``
    (None on the other ranks, which take part in the export's collectives and drop the tensors) through
    ``buckets``, a bucket transport."""

    def __init__(self, chunks: list, spec: ModelSpec, engines: Optional[Sequence], buckets: Optional[BucketTransport],
                 *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, engine_rank: int = 0, weight_dtype: str = "auto"):
        """``weight_dtype``: the engines' (``rollout.weight_dtype``); with ``fp8`` the buckets carry every linear
        weight blockwise-quantized with its scales (``rlmega.bridge.fp8``), about half the bytes."""
        self.chunks, self.spec, self.bucket_bytes, self.engine_rank = chunks, spec, bucket_bytes, engine_rank
        self.weight_dtype = weight_dtype
        self.engines = list(engines) if engines is not None else None
        self.buckets = buckets
        self.name = buckets.name if buckets is not None else "gathered"

    def push(self, version: int) -> SyncStats:
        """If the bucket transport fails, this rank still runs the export to its end (the other ranks are in its
        collectives), then raises ``TransportError``; the engine then refuses to generate until a later update
        completes."""
        totals = {"tensors": 0, "bytes": 0}
        started = time.perf_counter()
        buckets = _counted(self._buckets(), totals)
        if self.engines is None:
            for _ in buckets:
                pass
            return SyncStats(version=version, seconds=time.perf_counter() - started, **totals)
        try:
            stream_update(self.buckets, self.engines, buckets, version)
        except WeightSyncError:
            for _ in buckets:  # leave no rank waiting in the export's collectives
                pass
            raise
        return SyncStats(version=version, seconds=time.perf_counter() - started, transport=self.name, **totals)

    def _buckets(self) -> Iterable[NamedTensors]:
        """The stream this rank takes part in (rank ``engine_rank`` gets the tensors): the bridge's export."""
        exported = export_hf_buckets(self.chunks, self.spec, bucket_bytes=self.bucket_bytes,
                                     destinations=[self.engine_rank])
        if self.weight_dtype == "fp8" and self.engines is not None:
            exported = quantized_buckets(exported)
        return exported

    def close(self) -> None:
        if self.buckets is not None:  # None on the ranks that hold no engine
            self.buckets.release()  # a kept region or group, if the transport holds one

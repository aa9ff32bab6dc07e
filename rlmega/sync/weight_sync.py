"""Trained Megatron weights -> rollout engines, versioned: the run's ``WeightSync`` and the ways it moves weights.

A training rank's ``WeightSync`` is built once from the ``sync`` config (``SyncConfig.build``), with the engines
it feeds, and serves every update of the run: ``push(version)`` moves the weights through the ``Transport`` chosen
at construction, ``check(probes, version)`` runs the post-sync check. Both are collective over the model's ranks.

A ``Transport`` here is one whole way of moving a model (collective): ``GatheredTransport`` (``rlmega.sync.gathered``)
runs the bridge's bucketed export and streams rank 0's buckets through a bucket transport (``rlmega.sync.transports``:
in-process, object store, shared memory, broadcast), bucket n shipped while bucket n+1 is built; ``AdapterTransport``
(``rlmega.sync.lora_adapters``, ``sync.lora=adapters``) streams a LoRA actor's adapters alone the same way;
``ShardedSync`` (``rlmega.sync.vllm_sharded``) has every rank serve its own slices to vLLM's workers. The version an
engine serves is the engine's own record (``weight_version``); ``require_version`` compares it with what was pushed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

from rlmega.bridge import DEFAULT_BUCKET_BYTES
from rlmega.models.spec import ModelSpec
from rlmega.rollout.protocol import RolloutEngine
from rlmega.sync.config import SHARDED_RDT, SLICED, SyncConfig
from rlmega.sync.errors import StaleWeightsError
from rlmega.sync.gathered import GatheredTransport
from rlmega.sync.post_sync_check import PostSyncCheck
from rlmega.sync.stats import SyncStats
from rlmega.sync.registry import kept_transport, make_transport
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, BucketTransport

if TYPE_CHECKING:
    from rlmega.sync.lora_adapters import AdapterSource
    from rlmega.sync.sliced import SlicedSetup


class Transport(Protocol):
    """One way of moving this rank's model into the engines; collective over the model's ranks."""

    name: str

    def push(self, version: int) -> SyncStats:
        """Move the weights; on the sending rank, returns once every engine committed ``version``."""

    def close(self) -> None: ...


def require_version(engine: RolloutEngine, expected: int) -> None:
    """Raise ``StaleWeightsError`` unless ``engine`` serves weight version ``expected``."""
    served = engine.weight_version()
    if served != expected:
        raise StaleWeightsError(served, expected, type(engine).__name__)


class WeightSync:
    """A run's weight sync on one training rank: its transport, chosen once, and the post-sync check."""

    def __init__(self, transport: Transport, check: PostSyncCheck):
        self.transport, self._check = transport, check
        self.pushed_version: Optional[int] = None
        """The version of the last push that completed: what these ranks' weights are, for an engine that joins
        later (the engines' own records say what they serve)."""

    @classmethod
    def build(cls, config: SyncConfig, chunks: list, spec: ModelSpec, engines: Optional[list], *,
              atol: float, sliced: Optional["SlicedSetup"] = None, weight_dtype: str = "auto",
              adapters: Optional["AdapterSource"] = None) -> WeightSync:
        """This training rank's weight sync into ``engines`` (on rank 0, the sender; None on the other ranks), with
        its transport chosen now, once, and the post-sync check at tolerance ``atol``; ``sliced``: where things
        are, which the ``sliced`` transport plans by; ``weight_dtype``: the engines' (``fp8``: the bridge's buckets
        are quantized before they travel); ``adapters``: a LoRA actor's, which ``sync.lora=adapters`` sends alone.
        Collective."""
        if config.lora == "adapters":
            from rlmega.sync.lora_adapters import AdapterTransport

            if adapters is None:
                raise ValueError("sync.lora=adapters needs a LoRA actor "
                                 "(WeightSync.build's adapters=AdapterSource(...))")
            buckets = None if engines is None else make_transport(
                config.transport, engines, bucket_bytes=config.bucket_bytes, timeout_s=config.timeout_s)
            transport: Transport = AdapterTransport(chunks, spec, engines, buckets, adapters,
                                                    bucket_bytes=config.bucket_bytes)
        elif config.transport == SHARDED_RDT:
            from rlmega.sync.vllm_sharded import ShardedSync

            transport = ShardedSync(chunks, spec, engines, timeout_s=config.timeout_s)
        elif config.transport == SLICED:
            from rlmega.sync.sliced import sliced_transport

            if sliced is None:
                raise ValueError("sync.transport=sliced needs the run's layout and checkpoint (WeightSync.build's "
                                 "sliced=SlicedSetup(...))")
            transport = sliced_transport(chunks, spec, sliced, engines, bucket_bytes=config.bucket_bytes,
                                         timeout_s=config.timeout_s)
        else:
            buckets = None if engines is None else make_transport(
                config.transport, engines, bucket_bytes=config.bucket_bytes, timeout_s=config.timeout_s)
            transport = GatheredTransport(chunks, spec, engines, buckets, bucket_bytes=config.bucket_bytes,
                                          weight_dtype=weight_dtype)
        return cls(transport, PostSyncCheck(chunks, spec, engines, atol))

    def push(self, version: int) -> SyncStats:
        """The trained weights into every engine as ``version``; this rank's share of the bytes moved."""
        stats = self.transport.push(version)
        self.pushed_version = version
        return stats

    def check(self, probes: list[list[int]], version: int) -> float:
        """The post-sync check on ``probes``: the largest log-prob difference between engines and trainer;
        ``WeightSyncError`` above the tolerance, ``StaleWeightsError`` if an engine answered with another version."""
        return self._check.run(probes, version)

    def close(self) -> None:
        self.transport.close()


def push_weights(
    chunks: list, spec: ModelSpec, engine: Union[RolloutEngine, Sequence[RolloutEngine], None], version: int, *,
    engine_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: Union[str, BucketTransport] = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SyncStats:
    """One update outside a run's ``WeightSync`` (scripts, benchmarks): this model's HF weights into ``engine`` as
    ``version``, then a check that every engine serves it. Collective; ``engine`` is the engine (or a list of
    engines) on ``engine_rank`` and None elsewhere. ``transport`` is a name from ``rlmega.sync.TRANSPORTS``,
    ``"auto"`` (in-process for an engine object here, shared memory for engine actors on this host, Ray's object
    store for the others) or a configured bucket transport; one given by name is made once per set of engines in
    this process and kept for the next updates (``kept_transport``). ``timeout_s`` bounds every wait on an engine."""
    engines = None if engine is None else list(engine) if isinstance(engine, (list, tuple)) else [engine]
    buckets = None
    if engines is not None:
        buckets = transport if not isinstance(transport, str) else kept_transport(
            transport, engines, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    stats = GatheredTransport(chunks, spec, engines, buckets, bucket_bytes=bucket_bytes,
                              engine_rank=engine_rank).push(version)
    for each in engines or ():
        require_version(each, version)
    return stats

"""Trained Megatron weights -> rollout engines, versioned and checked.

``push_weights`` streams the bridge's bucketed export, bucket by bucket, through a transport
(``rlmega.sync.transports``) into the engine(s) held by one rank (the other ranks take part in the
export's collectives and drop the tensors); the transport ships bucket n while the export builds
bucket n+1. ``require_version`` is the trainer's check that an engine serves the version it
expects. ``post_sync_check`` then lets the engine generate greedily from probe prompts and scores
the same tokens with the trainer's model: if the engine's log-probs disagree, the weights it serves
are not the trained ones (a wrong mapping, a missed bucket) and the run stops loudly instead of
training on samples from the wrong policy.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from rlmega.bridge import DEFAULT_BUCKET_BYTES
from rlmega.bridge.export import export_hf_buckets
from rlmega.models.spec import ModelSpec
from rlmega.rollout.protocol import RolloutEngine, SamplingParams
from rlmega.sync.buckets import NamedTensors, nbytes_of
from rlmega.sync.errors import StaleWeightsError, WeightSyncError
from rlmega.sync.registry import kept_transport
from rlmega.sync.transports import DEFAULT_TIMEOUT_S, Transport, stream_update
from rlmega.workers.forward import sequence_logprobs


@dataclasses.dataclass(frozen=True)
class SyncStats:
    version: int
    tensors: int
    bytes: int
    seconds: float
    transport: Optional[str] = None  # None on the ranks that hold no engine

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def require_version(engine: RolloutEngine, expected: int) -> None:
    """Raise ``StaleWeightsError`` unless ``engine`` serves weight version ``expected``."""
    served = engine.weight_version()
    if served != expected:
        raise StaleWeightsError(served, expected, type(engine).__name__)


def _counted(buckets: Iterable[NamedTensors], totals: dict) -> Iterator[NamedTensors]:
    for bucket in buckets:
        totals["tensors"] += len(bucket)
        totals["bytes"] += nbytes_of(bucket)
        yield bucket


def push_weights(
    chunks: list, spec: ModelSpec, engine: Union[RolloutEngine, Sequence[RolloutEngine], None], version: int, *,
    engine_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: Union[str, Transport] = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S, check_version: bool = True,
) -> SyncStats:
    """Stream this model's HF weights into ``engine`` as ``version``. Collective; ``engine`` is the
    engine (or a list of engines) on ``engine_rank`` and None elsewhere (only that rank receives the
    tensors). ``transport`` is a name from ``rlmega.sync.TRANSPORTS``, ``"auto"`` (in-process for an
    engine object here, shared memory for engine actors on this host, Ray's object store for the
    others) or a configured ``Transport``; a transport given by name is made once per set of engines
    in this process and kept for the next syncs (``kept_transport``). ``timeout_s`` bounds every wait on
    an engine. ``check_version``: ask every engine which version it serves afterwards (one more call
    each; a caller that asks all engines itself right after can leave it to that).

    If the transport fails, this rank still runs the export to its end (the other ranks are in its
    collectives), then raises ``TransportError``; the engine then refuses to generate until a later
    update completes. Returns what reached this rank and how fast.
    """
    totals = {"tensors": 0, "bytes": 0}
    started = time.perf_counter()
    buckets = _counted(export_hf_buckets(chunks, spec, bucket_bytes=bucket_bytes, destinations=[engine_rank]), totals)
    if engine is None:
        for _ in buckets:
            pass
        return SyncStats(version=version, seconds=time.perf_counter() - started, **totals)
    engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
    chosen = transport if not isinstance(transport, str) else kept_transport(
        transport, engines, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    try:
        stream_update(chosen, engines, buckets, version)
    except WeightSyncError:
        for _ in buckets:  # leave no rank waiting in the export's collectives
            pass
        raise
    if check_version:
        for each in engines:
            require_version(each, version)
    return SyncStats(version=version, seconds=time.perf_counter() - started, transport=chosen.name, **totals)


@torch.no_grad()
def post_sync_check(
    chunks: list,
    spec: ModelSpec,
    engine: Optional[RolloutEngine],
    prompts: list[list[int]],
    *,
    engine_rank: int = 0,
    max_new_tokens: int = 8,
    atol: float = 1e-3,
    version: Optional[int] = None,
) -> float:
    """Greedy probe generations from the engine, re-scored by the trainer; returns the largest
    log-prob difference and raises WeightSyncError above ``atol``. Collective over the model's ranks.
    With ``version``, the probes must also have been generated by that weight version
    (``StaleWeightsError`` otherwise, on every rank).

    ``atol`` must cover the numerical gap between the engine's kernels and the trainer's (about
    1e-5 for fp32 on CPU, much more for bf16 on GPU); a wrong mapping is off by orders of magnitude.
    """
    payload = [None]
    if dist.get_rank() == engine_rank:
        generations = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        payload = [([(list(g.response_token_ids), list(g.logprobs)) for g in generations],
                    min(g.weight_version for g in generations))]
    dist.broadcast_object_list(payload, src=engine_rank)
    probes, served = payload[0]
    if version is not None and served != version:
        raise StaleWeightsError(served, version, "the engine (in its probe generations)")
    sequences, engine_logprobs = [], []
    for prompt, (response, logprobs) in zip(prompts, probes):
        sequences.append(torch.tensor(prompt + response))
        engine_logprobs.append(torch.tensor(logprobs))
    trainer_logprobs = sequence_logprobs(chunks, spec, sequences)
    worst = 0.0
    for prompt, engine_lp, trainer_lp in zip(prompts, engine_logprobs, trainer_logprobs):
        response_lp = trainer_lp[len(prompt) - 1 :]
        # NaN compares false with everything, so a blown-up model would pass a plain threshold test.
        for side, values in (("trainer", response_lp), ("engine", engine_lp)):
            if not torch.isfinite(values).all():
                raise WeightSyncError(
                    f"post-sync check failed: the {side}'s log-probs on the probe prompts are not finite "
                    "(inf or nan): the trained weights blew up (a learning rate too high, or a skipped "
                    "non-finite step followed by more); resume from an earlier checkpoint with a lower lr"
                )
        worst = max(worst, (response_lp - engine_lp).abs().max().item())
    if worst > atol:
        raise WeightSyncError(
            f"post-sync check failed: engine and trainer log-probs differ by up to {worst:.3g} (> {atol:g}) "
            "on the probe prompts; the engine is not serving the trained weights"
        )
    return worst

"""Trained Megatron weights -> a rollout engine, versioned and checked.

``push_weights`` streams the bridge's bucketed export into ``engine.update_weights`` on the rank that
holds the engine (the other ranks take part in the export's collectives and drop the tensors).
``post_sync_check`` then lets the engine generate greedily from probe prompts and scores the same
tokens with the trainer's model: if the engine's log-probs disagree, the weights it serves are not
the trained ones (a wrong mapping, a missed bucket) and the run stops loudly instead of training
on samples from the wrong policy.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from rlmega.bridge import DEFAULT_BUCKET_BYTES, export_hf_weights
from rlmega.models.spec import ModelSpec
from rlmega.rollout.protocol import RolloutEngine, SamplingParams
from rlmega.workers.forward import sequence_logprobs


class WeightSyncError(RuntimeError):
    """The engine does not serve the weights the trainer holds."""


@dataclasses.dataclass(frozen=True)
class SyncStats:
    version: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _counted(stream: Iterable[tuple[str, torch.Tensor]], totals: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in stream:
        totals["tensors"] += 1
        totals["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def push_weights(
    chunks: list, spec: ModelSpec, engine: Optional[RolloutEngine], version: int, *,
    engine_rank: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncStats:
    """Stream this model's HF weights into ``engine`` as ``version``. Collective; ``engine`` is the
    engine on ``engine_rank`` and None elsewhere (only that rank receives the tensors). Returns what
    reached this rank and how fast."""
    totals = {"tensors": 0, "bytes": 0}
    started = time.perf_counter()
    stream = _counted(export_hf_weights(chunks, spec, bucket_bytes=bucket_bytes, destinations=[engine_rank]), totals)
    if engine is None:
        for _ in stream:
            pass
    else:
        engine.update_weights(stream, version)
        if engine.weight_version() != version:
            raise WeightSyncError(f"engine reports weight version {engine.weight_version()} after syncing version {version}")
    return SyncStats(version=version, seconds=time.perf_counter() - started, **totals)


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
) -> float:
    """Greedy probe generations from the engine, re-scored by the trainer; returns the largest
    log-prob difference and raises WeightSyncError above ``atol``. Collective over the model's ranks.

    ``atol`` must cover the numerical gap between the engine's kernels and the trainer's (about
    1e-5 for fp32 on CPU, much more for bf16 on GPU); a wrong mapping is off by orders of magnitude.
    """
    payload = [None]
    if dist.get_rank() == engine_rank:
        generations = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        payload = [[(list(g.response_token_ids), list(g.logprobs)) for g in generations]]
    dist.broadcast_object_list(payload, src=engine_rank)
    sequences, engine_logprobs = [], []
    for prompt, (response, logprobs) in zip(prompts, payload[0]):
        sequences.append(torch.tensor(prompt + response))
        engine_logprobs.append(torch.tensor(logprobs))
    trainer_logprobs = sequence_logprobs(chunks, spec, sequences)
    worst = 0.0
    for prompt, engine_lp, trainer_lp in zip(prompts, engine_logprobs, trainer_logprobs):
        response_lp = trainer_lp[len(prompt) - 1 :]
        worst = max(worst, (response_lp - engine_lp).abs().max().item())
    if worst > atol:
        raise WeightSyncError(
            f"post-sync check failed: engine and trainer log-probs differ by up to {worst:.3g} (> {atol:g}) "
            "on the probe prompts; the engine is not serving the trained weights"
        )
    return worst

"""Run an ``HFEngine`` in a Ray actor, and talk to it through the ``RolloutEngine`` protocol.

The only Ray-aware part of ``rlmega.rollout``; engines themselves are plain in-process objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ray
import torch
from ray.actor import ActorHandle

from rlmega.rollout.hf_engine import HFEngine
from rlmega.rollout.protocol import Generation, SamplingParams


def start_engine_actor(model, *, num_cpus: float = 1, num_gpus: float = 0, **engine_kwargs) -> ActorHandle:
    """Start ``HFEngine(model, **engine_kwargs)`` in a new actor of the running Ray cluster."""
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(HFEngine).remote(model, **engine_kwargs)


class RemoteEngine:
    """``RolloutEngine`` over an engine actor: each call blocks until the actor answers, and the
    actor's exceptions re-raise here (wrapped by Ray, with the original as their cause)."""

    def __init__(self, actor: ActorHandle, *, bucket_bytes: int = 256 * 1024**2):
        self.actor = actor
        self.bucket_bytes = bucket_bytes

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        return ray.get(self.actor.generate.remote(prompts, params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # A generator cannot cross processes: the stream travels in buckets of about bucket_bytes,
        # one actor call each, and the version commits after the last.
        ray.get(self.actor.begin_update.remote(version))
        bucket, size = [], 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor.detach().clone()))  # the stream may reuse its buffers
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                ray.get(self.actor.write_weights.remote(bucket))
                bucket, size = [], 0
        if bucket:
            ray.get(self.actor.write_weights.remote(bucket))
        ray.get(self.actor.commit_update.remote())

    def weight_version(self) -> int:
        return ray.get(self.actor.weight_version.remote())

    def sleep(self, level: int = 1) -> None:
        ray.get(self.actor.sleep.remote(level))

    def wake(self) -> None:
        ray.get(self.actor.wake.remote())

    def health(self) -> dict:
        return ray.get(self.actor.health.remote())

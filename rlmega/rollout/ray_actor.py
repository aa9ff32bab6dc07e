"""Run an ``HFEngine`` in a Ray actor, and talk to it through the ``RolloutEngine`` protocol.

The only Ray-aware part of ``rlmega.rollout``; engines themselves are plain in-process objects.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import ray
import torch
from ray.actor import ActorHandle

from rlmega.rollout.protocol import Generation, SamplingParams

# Engine actors are threaded, so that pause_generation (and weight_version, health) reach the actor while a
# generate runs; the engines serialise their own model and weight work. Enough threads for a running
# generate, a waiting update and the calls that answer at once.
ENGINE_ACTOR_CONCURRENCY = 4


def start_engine_actor(model, *, num_cpus: float = 1, num_gpus: float = 0, **engine_kwargs) -> ActorHandle:
    """Start ``HFEngine(model, **engine_kwargs)`` in a new threaded actor of the running Ray cluster."""
    from rlmega.rollout.hf_engine import HFEngine  # here: a training rank that holds engine handles needs no model code

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=ENGINE_ACTOR_CONCURRENCY)(
        HFEngine).remote(model, **engine_kwargs)


def _node_id(_actor) -> str:
    return ray.get_runtime_context().get_node_id()


class RemoteEngine:
    """``RolloutEngine`` over an engine actor: each call blocks until the actor answers, and the
    actor's exceptions re-raise here (wrapped by Ray, with the original as their cause)."""

    def __init__(self, actor: ActorHandle, *, bucket_bytes: int = 256 * 1024**2, key: str | None = None):
        self.actor = actor
        self.bucket_bytes = bucket_bytes
        self.key = key
        """The actor's id (``ray.get_runtime_context().get_actor_id()`` inside it), the same in every copy of
        this handle: a weight sync keeps one transport per engine by it (``rlmega.sync.kept_transport``)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 images=None) -> list[Generation]:
        extra = {} if images is None else {"images": images}
        return ray.get(self.actor.generate.remote(prompts, params, **extra))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # A generator cannot cross processes: the stream travels in buckets of about bucket_bytes,
        # one actor call each, and the version commits after the last. At most two calls are in
        # flight, so the actor copies bucket n in while this side gathers bucket n+1.
        ray.get(self.actor.begin_update.remote(version))
        in_flight: deque = deque()
        bucket, size = [], 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor.detach().clone()))  # the stream may reuse its buffers
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                in_flight.append(self.actor.write_weights.remote(bucket))
                bucket, size = [], 0
                if len(in_flight) == 2:
                    ray.get(in_flight.popleft())
        if bucket:
            in_flight.append(self.actor.write_weights.remote(bucket))
        ray.get(list(in_flight))
        ray.get(self.actor.commit_update.remote())

    def start_update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Future:
        """Start ``update_weights(named_tensors, version)`` inside the actor and return at once.

        ``named_tensors`` is pickled into the actor's process and iterated there, so it must bring
        its own tensors: a weight-sync transport's receiving side (``rlmega.sync``). The future
        fails if the update raises or the actor dies."""
        return self.actor.update_weights.remote(named_tensors, version).future()

    def is_local(self) -> bool:
        """Whether the actor runs on this process's Ray node (so host shared memory reaches it)."""
        here = ray.get_runtime_context().get_node_id()
        return ray.get(self.actor.__ray_call__.remote(_node_id)) == here

    def weight_version(self) -> int:
        return ray.get(self.actor.weight_version.remote())

    def pause_generation(self) -> None:
        """Reaches a running ``generate`` because the actor is threaded (``ENGINE_ACTOR_CONCURRENCY``)."""
        ray.get(self.actor.pause_generation.remote())

    def resume_generation(self) -> None:
        ray.get(self.actor.resume_generation.remote())

    def sleep(self, level: int = 1) -> None:
        ray.get(self.actor.sleep.remote(level))

    def wake(self) -> None:
        ray.get(self.actor.wake.remote())

    def health(self) -> dict:
        return ray.get(self.actor.health.remote())

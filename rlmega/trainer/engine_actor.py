"""Run an ``HFEngine`` in a Ray actor, and talk to it through the ``RolloutEngine`` protocol.

The only Ray-aware part of ``rlmega.rollout``; engines themselves are plain in-process objects.
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import ray
import torch
from ray.actor import ActorHandle

from rlmega.rollout.protocol import Generation, SamplingParams

# Engine actors are threaded, so that pause_generation (and weight_version, health) reach the actor while a
# generate runs. Enough threads for those calls; the model calls have a thread of their own (MODEL_THREAD).
ENGINE_ACTOR_CONCURRENCY = 4
MODEL_THREAD = "model"


def engine_actor_class(engine_class: type):
    """``engine_class`` as a threaded Ray actor class whose model calls all run on one thread.

    Ray runs a threaded actor's calls on any thread of its pool, and torch's OpenMP keeps a team of
    worker threads per calling thread: model calls that hop between threads cost more (the quickstart's
    generate on CPU: 26 ms instead of 20 ms). So the methods marked ``runs_model`` (generate, the
    update steps, sleep, wake; they run one at a time anyway) go to a concurrency group of one thread,
    and the rest (pause, resume, version, health) to the pool, where they answer while a model call runs.
    """
    def on_model_thread(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            return method(self, *args, **kwargs)
        # Ray reads the group from the innermost function: keep the signature, drop the link to the original.
        call.__signature__ = inspect.signature(method)
        del call.__wrapped__
        return ray.method(concurrency_group=MODEL_THREAD)(call)

    pinned = {name: on_model_thread(member) for name, member in inspect.getmembers(engine_class, inspect.isfunction)
              if getattr(member, "runs_model", False)}
    subclass = type(engine_class.__name__, (engine_class,), {
        **pinned, "__module__": engine_class.__module__, "__qualname__": engine_class.__qualname__,
        "__doc__": engine_class.__doc__})
    return ray.remote(concurrency_groups={MODEL_THREAD: 1}, max_concurrency=ENGINE_ACTOR_CONCURRENCY)(subclass)


def start_engine_actor(model, *, num_cpus: float = 1, num_gpus: float = 0, **engine_kwargs) -> ActorHandle:
    """Start ``HFEngine(model, **engine_kwargs)`` in a new threaded actor of the running Ray cluster."""
    from rlmega.rollout.hf_engine import HFEngine  # here: a training rank that holds engine handles needs no model code

    return engine_actor_class(HFEngine).options(num_cpus=num_cpus, num_gpus=num_gpus).remote(model, **engine_kwargs)


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

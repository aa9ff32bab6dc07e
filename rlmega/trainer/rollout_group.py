"""Rollout engines as Ray actors: prompts are split over the engines, answers merged in order.

``rollout.backend`` picks the engine class: ``hf`` (transformers; CPU, or GPU when
``rollout.gpus_per_engine > 0``), ``vllm`` or ``sglang`` (GPU; their adapters in ``rlmega.rollout``).
The engine-level rollout fields (memory share, engine parallel sizes, batched tokens) go to the
engine's constructor under the backend's names (``RolloutConfig.engine_arguments``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from rlmega.config.schema import RLConfig
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.trainer.remote import WorkerFailure, name_actors, wait_all

if TYPE_CHECKING:
    import ray


def _engine_node(_actor) -> tuple[str, str, str, str]:
    import os

    import ray

    context = ray.get_runtime_context()
    return (context.get_node_id(), ray.util.get_node_ip_address(), context.get_actor_id(),
            os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # the GPUs it runs on, for placement.json


class RolloutGroup:
    """``rollout.num_engines`` engines of ``rollout.backend``, each in its own actor, placed by
    ``scheduling(i)`` (a Ray scheduling strategy for engine i); ``record_routing``: every generation
    carries its MoE routing (R3 routing replay)."""

    def __init__(self, config: RLConfig, scheduling, name: str = "rollout engine", record_routing: bool = False,
                 wait: bool = True, env: Optional[Callable[[int], dict[str, str]]] = None):
        """Start the engine actors; ``wait``: and return once every engine has started (else call
        ``wait_started``, e.g. after starting the training ranks, so that both start at once). ``env(i)``:
        more environment variables of engine i (the GPUs it shares, ``rlmega.trainer.engine_devices``)."""
        from rlmega.rollout.ray_actor import RemoteEngine, engine_actor_class
        from rlmega.trainer.worker_logs import actor_env, logged

        self.config = config
        self.timeout_s = config.cluster.timeout_s
        engine_class, arguments = _engine(config)
        if record_routing:  # MoE routing replay (R3): the actor replays the experts the engines chose
            arguments["record_routing"] = True
        threads = str(max(1, int(config.rollout.cpus_per_engine)))
        self.names = [f"{name} {index}" for index in range(config.rollout.num_engines)]
        self.actors = [
            engine_actor_class(logged(engine_class)).options(  # threaded: a pause reaches a running generate
                num_cpus=config.rollout.cpus_per_engine, num_gpus=config.rollout.gpus_per_engine,
                scheduling_strategy=scheduling(index),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, **actor_env(config.run_dir, name),
                                          **(env(index) if env else {})}},
            ).remote(config.model.path, **arguments)
            for index, name in enumerate(self.names)
        ]
        self.engines = [RemoteEngine(actor, bucket_bytes=config.sync.bucket_bytes) for actor in self.actors]
        self._located = [actor.__ray_call__.remote(_engine_node) for actor in self.actors]
        self.nodes: list[dict] = []
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Return once every engine has started (its constructor returned); WorkerFailure names one that did
        not. Fills ``nodes``."""
        located = wait_all(self._located, self.names, max(self.timeout_s, 300.0), "starting engines")
        self.nodes = [{"engine": index, "node_id": node, "ip": ip, "gpus": gpus}
                      for index, (node, ip, _, gpus) in enumerate(located)]
        name_actors([actor_id for _, _, actor_id, _ in located], self.names)  # the ranks call them too
        for engine, (_, _, actor_id, _) in zip(self.engines, located):
            engine.key = actor_id  # the ranks' weight syncs keep one transport per engine by it

    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[Generation]:
        """Responses of all prompts, prompt-major; prompts are split into contiguous shares per engine.
        ``images``: a vision-language model's, per prompt (``ImageInputs`` or None)."""
        shares = _contiguous_shares(len(prompts), len(self.actors))
        refs, names = [], []
        for index, (start, stop) in enumerate(shares):
            if stop > start:
                # Each engine gets its own seed so two engines never draw the same samples.
                engine_params = params if params.seed is None else _with_seed(params, params.seed + 7919 * index)
                extra = {} if images is None else {"images": images[start:stop]}
                refs.append(self.actors[index].generate.remote(prompts[start:stop], engine_params, **extra))
                names.append(self.names[index])
        answers = wait_all(refs, names, self.timeout_s, "generate")
        merged = []
        for (start, _), generations in zip([s for s in shares if s[1] > s[0]], answers):
            for generation in generations:
                generation.prompt_index += start
                merged.append(generation)
        return merged

    @property
    def num_engines(self) -> int:
        return len(self.actors)

    def submit(self, engine_index: int, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams], images=None) -> ray.ObjectRef:
        """Start ``generate(prompts, params)`` on one engine and return at once: a ``ray.ObjectRef`` to its
        ``list[Generation]`` (``prompt_index`` into ``prompts``). Seeds are used as given."""
        extra = {} if images is None else {"images": images}
        return self.actors[engine_index].generate.remote(prompts, params, **extra)

    def pause_generation(self) -> None:
        """Every engine interrupts its running ``generate`` calls (their unfinished responses come back
        "abort"; vLLM 0.11 lets a running call finish) and answers new ones at once with empty aborts,
        until ``resume_generation``. See ``RolloutEngine.pause_generation``."""
        wait_all([actor.pause_generation.remote() for actor in self.actors], self.names, self.timeout_s,
                 "pause_generation")

    def resume_generation(self) -> None:
        wait_all([actor.resume_generation.remote() for actor in self.actors], self.names, self.timeout_s,
                 "resume_generation")

    def versions(self) -> list[int]:
        return wait_all([actor.weight_version.remote() for actor in self.actors], self.names, self.timeout_s, "weight_version")

    def sleep(self, level: int = 1) -> None:
        wait_all([actor.sleep.remote(level) for actor in self.actors], self.names, self.timeout_s, "sleep")

    def wake(self) -> None:
        wait_all([actor.wake.remote() for actor in self.actors], self.names, self.timeout_s, "wake")

    def check_alive(self) -> None:
        """Raise WorkerFailure naming an engine that no longer answers."""
        health = wait_all([actor.health.remote() for actor in self.actors], self.names, 60.0, "health check")
        for name, report in zip(self.names, health):
            if not isinstance(report, dict):
                raise WorkerFailure(f"health check: {name} answered {report!r}")

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def _engine(config: RLConfig) -> tuple[type, dict]:
    """The engine class of ``rollout.backend`` and its constructor arguments."""
    import torch

    rollout = config.rollout
    arguments = rollout.engine_arguments()
    if rollout.backend == "hf":
        from rlmega.rollout.hf_engine import HFEngine

        on_gpu = rollout.gpus_per_engine > 0
        arguments.setdefault("device", "cuda" if on_gpu else "cpu")
        arguments.setdefault("dtype", torch.bfloat16 if on_gpu else torch.float32)
        return HFEngine, arguments
    if rollout.backend == "vllm":
        from rlmega.rollout.vllm_engine import VLLMEngine
        from rlmega.sync.transports import SHARDED_RDT

        if rollout.gpus_of_one_engine > 1:
            # vLLM 0.33 picks its Ray executor for tp x dp > 1 inside a placement group (vllm/config/parallel.py),
            # whose workers would wait for GPUs this actor, or colocated the training ranks, already hold; its
            # multiprocessing executor starts them on the GPUs this actor sees.
            arguments.setdefault("distributed_executor_backend", "mp")
        if config.sync.transport == SHARDED_RDT:  # vLLM runs the weight-transfer backend it was built with
            arguments.setdefault("weight_transfer", SHARDED_RDT)
        return VLLMEngine, {"bucket_bytes": config.sync.bucket_bytes, **arguments}
    from rlmega.rollout.sglang_engine import SGLangEngine

    return SGLangEngine, {"bucket_bytes": config.sync.bucket_bytes, **arguments}


def _with_seed(params: SamplingParams, seed: Optional[int]) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


def _contiguous_shares(size: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(size * part / parts) for part in range(parts + 1)]
    return [(bounds[part], bounds[part + 1]) for part in range(parts)]

"""Rollout engines as Ray actors: prompts are split over the engines, answers merged in order.

``rollout.backend`` picks the engine class: ``hf`` (transformers; CPU, or GPU when
``rollout.gpus_per_engine > 0``), ``vllm`` or ``sglang`` (GPU; their adapters in ``rlmega.rollout``).
The engine-level rollout fields (memory share, engine parallel sizes, batched tokens) go to the
engine's constructor under the backend's names (``RolloutConfig.engine_arguments``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Optional

from rlmega.config.schema import RLConfig
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.trainer.engine_restarts import EngineRestarts
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
        from rlmega.trainer.engine_actor import RemoteEngine, engine_actor_class
        from rlmega.trainer.worker_logs import logged

        self.config = config
        self.timeout_s = config.cluster.timeout_s
        engine_class, self._arguments = _engine(config)
        if record_routing:  # MoE routing replay (R3): the actor replays the experts the engines chose
            self._arguments["record_routing"] = True
        self._actor_class = engine_actor_class(logged(engine_class))  # threaded: a pause reaches a running generate
        self._scheduling, self._env = scheduling, env
        self.names = [f"{name} {index}" for index in range(config.rollout.num_engines)]
        self.actors = [self._start(index) for index in range(config.rollout.num_engines)]
        self.engines = [RemoteEngine(actor, bucket_bytes=config.sync.bucket_bytes) for actor in self.actors]
        self._located = [actor.__ray_call__.remote(_engine_node) for actor in self.actors]
        self.nodes: list[dict] = []
        self.restarts = EngineRestarts(config.rollout) if config.rollout.restart_dead_engines else None
        """``rollout.restart_dead_engines``: the budget of ``replace``; None: an engine that dies stops the run."""
        self.unserved: set[int] = set()
        """Engines ``replace`` started that ``rejoin`` has not given the current weights yet: they get no request."""
        self._replacing = threading.Lock()
        if wait:
            self.wait_started()

    def _start(self, index: int):
        """A new actor of engine ``index``, on its placement and devices."""
        from rlmega.trainer.worker_logs import actor_env

        config = self.config
        threads = str(max(1, int(config.rollout.cpus_per_engine)))
        return self._actor_class.options(
            num_cpus=config.rollout.cpus_per_engine, num_gpus=config.rollout.gpus_per_engine,
            scheduling_strategy=self._scheduling(index),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, **actor_env(config.run_dir, self.names[index]),
                                      **(self._env(index) if self._env else {})}},
        ).remote(config.model.path, **self._arguments)

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
        ``images``: a vision-language model's, per prompt (``ImageInputs`` or None). With ``restarts``, an engine
        that dies is replaced and given the current weights, and its share is generated again with the same seed."""
        import ray

        shares = {index: share for index, share in enumerate(_contiguous_shares(len(prompts), len(self.actors)))
                  if share[1] > share[0]}

        def submit(index: int):
            start, stop = shares[index]
            # Each engine gets its own seed so two engines never draw the same samples.
            engine_params = params if params.seed is None else _with_seed(params, params.seed + 7919 * index)
            extra = {} if images is None else {"images": images[start:stop]}
            return self.actors[index].generate.remote(prompts[start:stop], engine_params, **extra)

        self.rejoin()
        requests = {submit(index): index for index in shares}
        answers = {}
        while requests:
            done, _ = ray.wait(list(requests), num_returns=1, timeout=self.timeout_s)
            if not done:
                late = ", ".join(self.names[index] for index in requests.values())
                raise WorkerFailure(f"generate: no answer from {late} within {self.timeout_s:.0f} s")
            index = requests.pop(done[0])
            try:
                answers[index] = wait_all(done, [self.names[index]], self.timeout_s, "generate")[0]
            except WorkerFailure as failure:
                if not self.replace(index, failure):
                    raise
                self.rejoin()
                start, stop = shares[index]
                self.restarts.resubmitted((stop - start) * params.n)
                requests[submit(index)] = index
        merged = []
        for index in sorted(answers):
            for generation in answers[index]:
                generation.prompt_index += shares[index][0]
                merged.append(generation)
        return merged

    def replace(self, index: int, failure: WorkerFailure) -> bool:
        """If ``failure`` is the death of engine ``index`` and ``restarts`` allow it: a new engine in its place, on the
        same resources, that gets no request until ``rejoin`` gave it the current weights; True. False when
        ``failure`` is something else (the caller raises it); WorkerFailure naming the engine when its restarts are
        spent. Safe from any thread: a dead actor is replaced once."""
        import ray

        from rlmega.trainer.engine_actor import RemoteEngine

        if self.restarts is None or failure.dead != self.names[index]:
            return False
        with self._replacing:
            if failure.actor_id is not None and failure.actor_id != self.engines[index].key:
                return True  # replaced already (a pause and the request it was running both saw it die)
            restarts = self.restarts.allow(index, failure)
            print(f"{failure}; restarting it in place (restart {restarts} of at most {self.restarts.limit} within "
                  f"{self.restarts.window_steps} steps)", flush=True)
            ray.kill(self.actors[index], no_restart=True)  # dead already; Ray lets go of what it held for it
            actor = self._start(index)
            node, ip, actor_id, gpus = wait_all([actor.__ray_call__.remote(_engine_node)], [self.names[index]],
                                                max(self.timeout_s, 300.0), "restarting an engine")[0]
            name_actors([actor_id], [self.names[index]])
            self.actors[index] = actor
            self.engines[index] = RemoteEngine(actor, bucket_bytes=self.config.sync.bucket_bytes, key=actor_id)
            self.nodes[index] = {"engine": index, "node_id": node, "ip": ip, "gpus": gpus}
            self.unserved.add(index)
        return True

    def rejoin(self) -> None:
        """The engines ``replace`` started get the weights the others serve, checked (the trainer's
        ``EngineRestarts.serve``): call it only while the training ranks are idle and hold those weights."""
        if self.restarts is None:
            return
        with self._replacing:
            for index in sorted(self.unserved):
                difference = self.restarts.serve(self.engines[index])
                self.unserved.discard(index)
                checked = ("" if difference is None
                           else f", post-sync check passed (max log-prob difference {difference:.2g})")
                print(f"{self.names[index]} restarted: it serves the current weights{checked}", flush=True)

    @property
    def num_engines(self) -> int:
        return len(self.actors)

    def submit(self, engine_index: int, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams], images=None) -> ray.ObjectRef:
        """Start ``generate(prompts, params)`` on one engine and return at once: a ``ray.ObjectRef`` to its
        ``list[Generation]`` (``prompt_index`` into ``prompts``). Seeds are used as given."""
        extra = {} if images is None else {"images": images}
        return self.actors[engine_index].generate.remote(prompts, params, **extra)

    def pause_generation(self) -> dict[int, WorkerFailure]:
        """Every engine interrupts its running ``generate`` calls (their unfinished responses come back
        "abort"; vLLM 0.11 lets a running call finish) and answers new ones at once with empty aborts,
        until ``resume_generation``. See ``RolloutEngine.pause_generation``. With ``restarts``, the engines that
        died are returned (index: how), for ``replace``; without, the first one raises."""
        return self._each("pause_generation")

    def resume_generation(self) -> dict[int, WorkerFailure]:
        return self._each("resume_generation")

    def _each(self, method: str) -> dict[int, WorkerFailure]:
        """Call ``method`` on every engine and wait for all; the engines that died (with ``restarts``)."""
        refs = [getattr(actor, method).remote() for actor in self.actors]
        if self.restarts is None:
            wait_all(refs, self.names, self.timeout_s, method)
            return {}
        dead = {}
        for index, (ref, name) in enumerate(zip(refs, self.names)):
            try:
                wait_all([ref], [name], self.timeout_s, method)
            except WorkerFailure as failure:
                if failure.dead != name:
                    raise
                dead[index] = failure
        return dead

    def handles(self) -> list:
        """The engines the weight sync feeds (``RemoteEngine``s, keyed by actor): those that serve weights, not those
        restarted in place that still wait for theirs (``rejoin`` gives them the weights on its own)."""
        return [engine for index, engine in enumerate(self.engines) if index not in self.unserved]

    def version(self) -> Optional[int]:
        """The weight version the engines serve, by their own record; None while none serves yet (every engine
        restarted in place and waiting for weights). ``StaleWeightsError`` if they serve different ones."""
        from rlmega.sync import StaleWeightsError

        serving = [index for index in range(len(self.actors)) if index not in self.unserved]
        if not serving:
            return None
        versions = wait_all([self.actors[index].weight_version.remote() for index in serving],
                            [self.names[index] for index in serving], self.timeout_s, "weight_version")
        if len(set(versions)) > 1:
            newest = max(versions)
            behind = [self.names[index] for index, found in zip(serving, versions) if found != newest]
            raise StaleWeightsError(min(versions), newest, f"{', '.join(behind)} (behind the other engines)")
        return versions[0]

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
        from rlmega.rollout.vllm_engine import VLLMEngine, executor_backend

        # the weight transfer the sync drives, and the adapters' rank with sync.lora=adapters
        for name, value in config.sync.engine_arguments(config.actor.lora.rank).items():
            arguments.setdefault(name, value)
        if rollout.gpus_of_one_engine > 1 and executor_backend(arguments.get("weight_transfer", "nccl")) is None:
            # vLLM 0.33 picks its Ray executor for tp x dp > 1 inside a placement group (vllm/config/parallel.py),
            # whose workers would wait for GPUs this actor, or colocated the training ranks, already hold; its
            # multiprocessing executor starts them on the GPUs this actor sees. (A transfer that needs an executor
            # of its own gets it from the adapter.)
            arguments.setdefault("distributed_executor_backend", "mp")
        return VLLMEngine, {"bucket_bytes": config.sync.bucket_bytes, **arguments}
    from rlmega.rollout.sglang_engine import SGLangEngine

    for name, value in config.sync.engine_arguments(config.actor.lora.rank).items():  # the adapters' rank
        arguments.setdefault(name, value)
    return SGLangEngine, {"bucket_bytes": config.sync.bucket_bytes, **arguments}


def _with_seed(params: SamplingParams, seed: Optional[int]) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


def _contiguous_shares(size: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(size * part / parts) for part in range(parts + 1)]
    return [(bounds[part], bounds[part + 1]) for part in range(parts)]

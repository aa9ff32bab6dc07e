"""Ray, placement groups and the worker groups.

*Colocated*: one bundle per training rank, big enough for the rank and its share of the engines;
engines run in those bundles and sleep while training runs (training offloads while they
generate). *Disaggregated*: training ranks and engines get bundles of their own (engines packed
on few nodes, or spread one per node). A reward model's ranks and a judge's engines always have
placement groups of their own (``start_reward_workers``): they score while the policy's parts work; so
have a distillation teacher's ranks (``start_teachers``), whose fractional GPUs may share the actor's.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Optional

from rlmega.config.schema import RLConfig
from rlmega.trainer.ray_console import quiet_worker_deaths

# A colocated vLLM engine under sync.transport=sharded_rdt runs on vLLM's Ray executor, whose workers are Ray actors
# in the placement group the engine runs in: each asks for VLLM_RAY_PER_WORKER_GPUS GPUs (1.0 unless set) of the
# bundle VLLM_RAY_BUNDLE_INDICES names for its rank (vllm/envs.py:1485-1491 in 0.33, :1567-1573 in 0.34;
# vllm/v1/executor/ray_executor_v2.py:276-282 and 306-315, RayExecutorV2, the executor "ray" selects;
# ray_utils.py:112-138 get_bundles_for_indices; a bundle may hold at most one GPU, :340-347). Those bundles are
# the training ranks', whose GPU the ranks hold: the ranks leave this share of it to the workers placed with them.
# Ray only books it; memory is shared as the engine's memory share and training's offload say.
ENGINE_WORKERS_GPU_SHARE = 0.1

_connected_here = False
"""``connect`` initialised Ray in this process (``disconnect`` ends it)."""


def connect(config: RLConfig) -> None:
    """Join the configured Ray cluster, or start a private local one sized for this job. A private one
    is watched by a guardian (``rlmega.launch.guardian``) that stops its processes if this driver dies;
    a joined cluster is left to Ray, which kills the actors a dead driver owned."""
    import ray

    from rlmega.launch.guardian import start_guardian

    global _connected_here
    if ray.is_initialized():
        return
    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        _require_ray_head(address, config.cluster.connect_timeout_s)
        ray.init(address=address, log_to_driver=True, logging_level=logging.ERROR)
        _connected_here = True
        quiet_worker_deaths(Path(config.run_dir) / "logs" / "ray-errors.log")
        return
    groups = (*_bundles(config), *_reward_bundles(config), *_teacher_bundles(config).values())
    needed = sum(bundle.get("CPU", 0) for bundles in groups for bundle in bundles)
    start_guardian()  # before the session's processes start, so that they inherit its run token
    ray.init(address="local", num_cpus=max(math.ceil(needed), os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=True, logging_level=logging.ERROR,
             _system_config=private_cluster_settings())
    _connected_here = True
    quiet_worker_deaths(Path(config.run_dir) / "logs" / "ray-errors.log")  # rlmega names dead workers itself


def _require_ray_head(address: str, timeout_s: float) -> None:
    """UserError unless a Ray head answers at ``address`` within ``timeout_s``: ``ray.init`` would retry for many
    minutes, silently, at a closed port or at a program that is not Ray. The address checked is the one
    ``ray.init`` connects to ("auto" read from RAY_ADDRESS or this machine's last ``ray start``, a loopback host
    replaced by this node's address)."""
    from ray._private.services import canonicalize_bootstrap_address

    from rlmega.errors import UserError
    from rlmega.launch.ports import ray_head_problem, split_address

    if address.startswith("ray://"):  # Ray Client: a proxy with its own protocol and its own timeout
        return
    fix = "or leave cluster.ray_address empty (and RAY_ADDRESS unset) for a private cluster on this machine"
    try:
        target = canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise UserError(f"cluster.ray_address={address}, but no Ray cluster was found (RAY_ADDRESS is unset and no "
                        f"`ray start` ran on this machine); give its HOST:PORT, {fix}") from None
    except ValueError as error:
        raise UserError(f"cluster.ray_address={address}: {error}; give HOST:PORT of a Ray head, {fix}") from None
    if target is None:  # "local": ray.init starts a cluster of its own
        return
    problem = ray_head_problem(target, timeout_s)
    if problem:
        shown = address if target == address else f"{address}, which Ray reaches as {target}"
        port = split_address(target)[1]
        raise UserError(f"no Ray cluster answers at {shown}: {problem} (cluster.connect_timeout_s); start one with "
                        f"`ray start --head --port={port}` {fix}")


def private_cluster_settings() -> dict[str, object]:
    """Ray settings of the private cluster a run starts (a ``RAY_<name>`` variable set by the user wins)."""
    settings = {
        # Every process reports an event record of each task to the GCS, which keeps up to 100k by default: a run
        # makes tens per step, so the GCS grew for hours (benchmarks/soak.py). Without a dashboard nobody reads
        # them: report none, and should a user turn reporting back on, keep only the last few.
        "task_events_report_interval_ms": 0,
        "task_events_max_num_task_in_gcs": 1000,
        # Nor the metrics and per-handler event statistics every Ray process records for the dashboard: without
        # them the raylet's heap grows at half the rate over a long run (benchmarks/soak.py).
        "enable_metrics_collection": False,
        "event_stats": False,
        # Ray starts one idle worker per CPU in advance; every rlmega actor sets its own environment (thread
        # count, log file), which an idle worker started without it cannot take: they only cost start-up CPU.
        "enable_worker_prestart": False,
        "prestart_worker_first_driver": False,
    }
    return {name: value for name, value in settings.items() if f"RAY_{name}" not in os.environ}


def disconnect() -> None:
    """Leave the Ray cluster that ``connect`` joined or started (a private one stops), now that the run's parts
    are shut down: left to the interpreter's exit, Ray first waits half a second for log lines to arrive.
    A cluster someone else connected this process to is left as it is."""
    import ray

    global _connected_here
    if _connected_here and ray.is_initialized():
        ray.shutdown()
    _connected_here = False


def _wait_ready(group, what: str, timeout_s: float) -> None:
    import ray

    try:
        ray.get(group.ready(), timeout=min(timeout_s, 120.0))
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"{what}: the Ray cluster could not place {group.bundle_specs} within {min(timeout_s, 120.0):.0f} s "
            f"(available: {ray.available_resources()}); lower cluster.cpus_per_rank / rollout.cpus_per_engine "
            "or add nodes"
        ) from None


@dataclasses.dataclass(frozen=True)
class RayExecutorShares:
    """How colocated engines on vLLM's Ray executor share the training bundles with the ranks."""

    rank_gpus: float
    """What each training rank asks of its bundle's GPU (``cluster.gpus_per_rank`` less the workers' share)."""
    worker_gpus: float
    """What each engine worker asks (``VLLM_RAY_PER_WORKER_GPUS``)."""
    bundles: list[list[int]]
    """Per engine, the training bundles of its workers in worker-rank order: those of the ranks whose GPUs it runs
    on (``rlmega.trainer.engine_devices``)."""

    def env(self, engine: int) -> dict[str, str]:
        """Engine ``engine``'s environment, read by vLLM where it starts its workers."""
        return {"VLLM_RAY_PER_WORKER_GPUS": f"{self.worker_gpus:g}",
                "VLLM_RAY_BUNDLE_INDICES": ",".join(str(bundle) for bundle in self.bundles[engine])}


def ray_executor_shares(config: RLConfig) -> Optional[RayExecutorShares]:
    """The shares when the run's engines run on the training ranks' GPUs through vLLM's Ray executor, else None."""
    from rlmega.rollout.vllm_engine import executor_backend
    from rlmega.trainer.engine_devices import shares_rank_gpus

    rollout, world = config.rollout, config.layout.world_size
    transfer = config.sync.engine_arguments().get("weight_transfer", "nccl") if rollout.backend == "vllm" else None
    size = rollout.gpus_of_one_engine
    if not (shares_rank_gpus(config) and transfer and executor_backend(transfer) == "ray") or size > world:
        return None  # (an engine larger than the world is refused when the engines are placed)
    bundles = [[(engine * size + offset) % world for offset in range(size)] for engine in range(rollout.num_engines)]
    per_bundle = max(collections.Counter(bundle for ranks in bundles for bundle in ranks).values())
    gpus = config.cluster.gpus_per_rank
    worker = round(ENGINE_WORKERS_GPU_SHARE * gpus / per_bundle, 4)
    return RayExecutorShares(rank_gpus=round(gpus - worker * per_bundle, 4), worker_gpus=worker, bundles=bundles)


def start_workers(config: RLConfig, *, with_rollout: bool = True):
    """(TrainingRanks, RolloutGroup or None, placement description) for ``config``, or their twins in this
    process when it runs in one (``cluster.in_process``); on failure, whatever was started is shut down again."""
    from rlmega.trainer.in_process import runs_in_process, start_in_process

    if runs_in_process(config):
        return start_in_process(config, with_rollout=with_rollout)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlmega.trainer.engine_devices import colocated_engine_places, shares_rank_gpus
    from rlmega.trainer.rollout_group import RolloutGroup
    from rlmega.trainer.training_group import TrainingRanks

    connect(config)
    training_bundles, engine_bundles = _bundles(config)
    world = config.layout.world_size
    shares = ray_executor_shares(config)
    ranks_config = config if shares is None else dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, gpus_per_rank=shares.rank_gpus))
    if config.rollout.placement == "colocated":
        training_pg = engine_pg = placement_group(training_bundles, strategy="PACK")
        _wait_ready(training_pg, "placing training ranks and engines", config.cluster.timeout_s)
        engine_bundle = lambda index: index % world  # noqa: E731
    else:
        training_pg = placement_group(training_bundles, strategy="PACK")
        _wait_ready(training_pg, "placing training ranks", config.cluster.timeout_s)
        strategy = "SPREAD" if config.rollout.engine_spread == "spread" else "PACK"
        engine_pg = placement_group(engine_bundles, strategy=strategy)
        _wait_ready(engine_pg, "placing rollout engines", config.cluster.timeout_s)
        engine_bundle = lambda index: index  # noqa: E731
    rollout = None

    def start_engines(places=None) -> None:
        nonlocal rollout
        bundle = (lambda index: places[index].bundle) if places else engine_bundle
        rollout = RolloutGroup(config, lambda index: PlacementGroupSchedulingStrategy(
            engine_pg, placement_group_bundle_index=bundle(index)),
            record_routing=config.actor.router_replay == "r3", wait=False,
            env=(lambda index: {**places[index].env(), **(shares.env(index) if shares else {})}) if places else None)

    # The engines start while the ranks set up (each takes seconds of imports and loading); engines that run
    # on the ranks' GPUs start once the ranks are placed, when Ray has told each rank its devices.
    placed = None
    if with_rollout and shares_rank_gpus(config):
        placed = lambda nodes: start_engines(  # noqa: E731
            colocated_engine_places(nodes, config.rollout.num_engines, config.rollout.gpus_of_one_engine))
    elif with_rollout:
        start_engines()
    try:
        training = TrainingRanks.for_policy(ranks_config, training_pg, total_steps=config.trainer.total_steps,
                                            placed=placed)
    except BaseException:
        if rollout is not None:
            rollout.shutdown()
        raise
    if rollout is None:
        return training, None, {"placement": config.rollout.placement, "training_ranks": training.nodes, "engines": []}
    try:
        rollout.wait_started()
    except BaseException:
        rollout.shutdown()
        training.shutdown()
        raise
    placement = {"placement": config.rollout.placement, "training_ranks": training.nodes, "engines": rollout.nodes}
    return training, rollout, placement


def start_reward_workers(config: RLConfig):
    """(RewardModelGroup or None, the judge's RolloutGroup or None, their placement description): the
    reward model's ranks (``reward_model.layout``) and the judge's engines, each in a placement group of
    its own. Nothing starts (not even Ray) when neither is enabled; on failure, whatever was started is
    shut down again."""
    import dataclasses

    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlmega.config.schema import ModelConfig
    from rlmega.trainer.roles import RewardModelGroup
    from rlmega.trainer.rollout_group import RolloutGroup
    from rlmega.trainer.training_group import TrainingRanks

    reward_model = judge = None
    placement: dict = {}
    if not (config.reward_model.enable or config.judge.enable):
        return reward_model, judge, placement
    connect(config)
    reward_bundles, judge_bundles = _reward_bundles(config)
    try:
        if config.reward_model.enable:
            reward_pg = placement_group(reward_bundles, strategy="PACK")
            _wait_ready(reward_pg, "placing reward-model ranks", config.cluster.timeout_s)
            ranks = TrainingRanks.for_frozen_model(config, config.reward_model, "reward-model rank", reward_pg)
            reward_model = RewardModelGroup(ranks)
            placement["reward_model_ranks"] = ranks.nodes
        if config.judge.enable:
            judge_pg = placement_group(judge_bundles, strategy="PACK")
            _wait_ready(judge_pg, "placing judge engines", config.cluster.timeout_s)
            # The judge's engines are rollout engines serving the judge's model.
            judge_view = dataclasses.replace(config, model=ModelConfig(path=config.judge.path),
                                             rollout=config.judge.engine_config())
            judge = RolloutGroup(judge_view, lambda index: PlacementGroupSchedulingStrategy(
                judge_pg, placement_group_bundle_index=index), name="judge engine")
            placement["judge_engines"] = judge.nodes
    except BaseException:
        for part in (reward_model, judge):
            if part is not None:
                part.shutdown()
        raise
    return reward_model, judge, placement


def start_teachers(config: RLConfig):
    """(Teachers or None, their placement description): each teacher of ``teacher`` (the main one and one per
    ``teacher.per_data_source`` entry) on ranks of its own (its ``layout``), in a placement group of its own.
    Nothing starts when ``teacher.enable`` is false; on failure, whatever was started is shut down again."""
    from ray.util.placement_group import placement_group

    from rlmega.trainer.roles import TeacherGroup, Teachers
    from rlmega.trainer.training_group import TrainingRanks

    if not config.teacher.enable:
        return None, {}
    connect(config)
    bundles = _teacher_bundles(config)
    groups: dict = {}
    placement: dict = {}
    try:
        for source, settings in config.teacher.models().items():
            name = "teacher rank" if source is None else f"teacher rank ({source})"
            group_pg = placement_group(bundles[source], strategy="PACK")
            _wait_ready(group_pg, f"placing {name}s", config.cluster.timeout_s)
            ranks = TrainingRanks.for_frozen_model(config, settings, name, group_pg)
            groups[source] = TeacherGroup(ranks)
            placement["teacher_ranks" if source is None else f"teacher_ranks/{source}"] = ranks.nodes
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    main = groups.pop(None)
    return Teachers(main, groups), placement


def _teacher_bundles(config: RLConfig) -> dict:
    """{data source (None: the main teacher): placement-group bundles of its ranks}; empty when disabled."""
    from rlmega.trainer.training_group import RankResources

    if not config.teacher.enable:
        return {}
    return {source: _nonzero(RankResources.of_frozen_model(settings, "teacher rank").bundles())
            for source, settings in config.teacher.models().items()}


def _reward_bundles(config: RLConfig) -> tuple[list[dict], list[dict]]:
    """Placement-group bundles of the reward model's ranks and of the judge's engines (empty when disabled)."""
    from rlmega.trainer.training_group import RankResources

    judge = config.judge
    reward = (_nonzero(RankResources.of_frozen_model(config.reward_model, "reward-model rank").bundles())
              if config.reward_model.enable else [])
    engines = ([{"CPU": judge.cpus_per_engine, "GPU": judge.gpus_per_engine}] * judge.num_engines
               if judge.enable else [])
    return reward, _nonzero(engines)


def _bundles(config: RLConfig) -> tuple[list[dict], list[dict]]:
    """Placement-group bundles of the training ranks and of the engines (the engines' list is empty
    when colocated: they share the training bundles, which are sized for both)."""
    world, engines = config.layout.world_size, config.rollout.num_engines
    rank = {"CPU": config.cluster.cpus_per_rank, "GPU": config.cluster.gpus_per_rank}
    engine = {"CPU": config.rollout.cpus_per_engine, "GPU": config.rollout.gpus_per_engine}
    if config.rollout.placement == "colocated":
        per_bundle = math.ceil(engines / world)
        return _nonzero([{name: rank[name] + per_bundle * engine[name] for name in rank}] * world), []
    return _nonzero([rank] * world), _nonzero([engine] * engines)


def _nonzero(bundles: list[dict]) -> list[dict]:
    return [{name: amount for name, amount in bundle.items() if amount > 0} for bundle in bundles]

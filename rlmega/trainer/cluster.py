"""Ray, placement groups and the two worker groups.

*Colocated*: one bundle per training rank, big enough for the rank and its share of the engines;
engines run in those bundles and sleep while training runs (training offloads while they
generate). *Disaggregated*: training ranks and engines get bundles of their own (engines packed
on few nodes, or spread one per node).
"""

from __future__ import annotations

import math
import os

from rlmega.config.schema import RLConfig


def connect(config: RLConfig) -> None:
    """Join the configured Ray cluster, or start a private local one sized for this job."""
    import ray

    if ray.is_initialized():
        return
    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    needed = sum(bundle.get("CPU", 0) for bundles in _bundles(config) for bundle in bundles)
    ray.init(address="local", num_cpus=max(math.ceil(needed), os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=True)


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


def start_workers(config: RLConfig, *, with_rollout: bool = True):
    """(TrainingRanks, RolloutGroup or None, placement description) for ``config``; on failure,
    whatever was started is shut down again."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlmega.trainer.rollout_group import RolloutGroup
    from rlmega.trainer.training_group import TrainingRanks

    connect(config)
    training_bundles, engine_bundles = _bundles(config)
    world = config.layout.world_size
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
    training = TrainingRanks(config, training_pg, total_steps=config.trainer.total_steps)
    if not with_rollout:
        return training, None, {"placement": config.rollout.placement, "training_ranks": training.nodes, "engines": []}
    try:
        rollout = RolloutGroup(config, lambda index: PlacementGroupSchedulingStrategy(
            engine_pg, placement_group_bundle_index=engine_bundle(index)))
    except BaseException:
        training.shutdown()
        raise
    placement = {"placement": config.rollout.placement, "training_ranks": training.nodes, "engines": rollout.nodes}
    return training, rollout, placement


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

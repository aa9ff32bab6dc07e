"""A colocated vLLM engine under sync.transport=sharded_rdt runs on vLLM's Ray executor, whose workers are Ray actors
asking for GPUs in the placement group the engine runs in: the training ranks' bundles, whose GPUs the ranks hold.
rlmega has the ranks leave a share of each GPU and tells the engine (VLLM_RAY_PER_WORKER_GPUS,
VLLM_RAY_BUNDLE_INDICES) to put each worker, with that share, in the bundle of the rank whose GPU it runs on
(rlmega.trainer.cluster.ray_executor_shares). On a private Ray that declares two GPUs, a stand-in for vLLM's executor
places its workers as the wheel does, and they land on the ranks' bundles and GPUs."""

import os

import pytest

from rlmega.config import load_config
from rlmega.trainer.cluster import ENGINE_WORKERS_GPU_SHARE, _bundles, ray_executor_shares

COLOCATED_RDT = ["rollout.backend=vllm", "sync.transport=sharded_rdt", "rollout.placement=colocated",
                 "rollout.gpus_per_engine=0", "cluster.gpus_per_rank=1"]


def _config(*overrides):
    return load_config("tiny_cpu", [*COLOCATED_RDT, *overrides], check=False)


def test_the_ranks_leave_the_engine_workers_a_share_of_their_gpus():
    shares = ray_executor_shares(_config("layout.world_size=4", "rollout.tensor_parallel_size=2",
                                         "rollout.num_engines=3"))
    assert shares.bundles == [[0, 1], [2, 3], [0, 1]]  # the ranks whose GPUs each engine runs on
    assert shares.worker_gpus == ENGINE_WORKERS_GPU_SHARE / 2  # two workers in bundles 0 and 1
    assert shares.rank_gpus + 2 * shares.worker_gpus <= 1.0 and shares.rank_gpus == 0.9
    assert shares.env(1) == {"VLLM_RAY_PER_WORKER_GPUS": "0.05", "VLLM_RAY_BUNDLE_INDICES": "2,3"}
    assert ray_executor_shares(_config("sync.transport=broadcast")) is None  # the multiprocessing executor
    assert ray_executor_shares(_config("rollout.placement=disaggregated", "rollout.gpus_per_engine=1")) is None


def _fake_executor():
    """vLLM's RayExecutorV2 as far as placement goes, to run in the engine's actor (returned as a local function so
    that Ray ships it by value): the placement group it runs in (vllm/v1/executor/ray_utils.py:332-333,
    get_current_placement_group), a worker per rank asking for VLLM_RAY_PER_WORKER_GPUS GPUs (vllm/envs.py:1485-1488,
    float, "1.0" when unset; ray_executor_v2.py:276-282) in the bundle VLLM_RAY_BUNDLE_INDICES names for it
    (envs.py:1491; ray_executor_v2.py:308-315 and 372-376). It returns each worker's bundle and the GPU ids Ray gave
    it."""
    def places_workers() -> list[tuple[int, list]]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        per_worker = float(os.getenv("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        bundles = [int(index) for index in os.getenv("VLLM_RAY_BUNDLE_INDICES", "").split(",") if index]
        assert bundles and len(set(bundles)) == len(bundles)  # ray_utils.py:118-127

        @ray.remote(num_cpus=0)
        def worker_gpus():
            return ray.get_gpu_ids()

        workers = [worker_gpus.options(num_gpus=per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle)).remote() for bundle in bundles]
        return list(zip(bundles, ray.get(workers, timeout=120)))

    return places_workers


@pytest.fixture
def ray_with_gpus():
    """A private Ray that declares two GPUs (none is needed: Ray only books and names them)."""
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.timeout(180)
def test_the_engine_workers_land_on_the_training_bundles_with_their_share(ray_with_gpus):
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = ray_with_gpus
    config = _config("rollout.tensor_parallel_size=2")  # one engine on both ranks' GPUs
    shares = ray_executor_shares(config)
    training_bundles, _ = _bundles(config)
    group = placement_group(training_bundles, strategy="PACK")
    ray.get(group.ready(), timeout=120)

    @ray.remote(num_cpus=0)
    def rank_gpus():
        return ray.get_gpu_ids()

    ranks = [rank_gpus.options(num_gpus=shares.rank_gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=bundle)).remote() for bundle in range(len(training_bundles))]
    held = ray.get(ranks, timeout=120)
    assert sorted(held) == [[0], [1]]  # each rank a GPU of its own, less the workers' share

    executor = ray.remote(num_cpus=0)(_fake_executor())
    placed = ray.get(executor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=shares.bundles[0][0]),
        runtime_env={"env_vars": shares.env(0)}).remote(), timeout=150)
    assert [bundle for bundle, _ in placed] == shares.bundles[0] == [0, 1]
    assert [gpus for _, gpus in placed] == held  # each worker on the GPU of the rank whose bundle it is in
    assert shares.worker_gpus == ENGINE_WORKERS_GPU_SHARE
    assert placement_group_table(group)["bundles"][0]["GPU"] == 1.0  # vLLM takes no bundle of more than one GPU


def test_a_whole_gpu_per_worker_does_not_fit_beside_a_rank():
    """What the wheel's default (VLLM_RAY_PER_WORKER_GPUS unset: 1.0) asks of a bundle whose rank holds its GPU."""
    config = _config("rollout.tensor_parallel_size=2")
    (bundle, _), _ = _bundles(config)
    assert config.cluster.gpus_per_rank + 1.0 > bundle["GPU"]
    shares = ray_executor_shares(config)
    assert shares.rank_gpus + shares.worker_gpus <= bundle["GPU"]


def test_start_workers_gives_the_ranks_and_the_engines_their_shares(monkeypatch, tmp_path):
    """``start_workers`` with Ray's calls replaced: the ranks ask for their share, each engine gets its workers'."""
    import importlib

    from rlmega.trainer import cluster, rollout_group, training_group

    seen = {}

    def ranks(config, placement_group, total_steps, placed=None):
        seen["rank_gpus"] = config.cluster.gpus_per_rank
        placed([{"rank": 0, "node_id": "a", "gpus": "3"}, {"rank": 1, "node_id": "a", "gpus": "5"}])
        return type("Ranks", (), {"nodes": [], "shutdown": lambda self: None})()

    def engines(config, scheduling, record_routing=False, wait=True, env=None):
        seen["env"] = [env(index) for index in range(config.rollout.num_engines)]
        return type("Group", (), {"nodes": [], "wait_started": lambda self: None, "shutdown": lambda self: None})()

    monkeypatch.setattr(cluster, "connect", lambda config: None)
    monkeypatch.setattr(cluster, "_wait_ready", lambda group, what, timeout_s: None)
    monkeypatch.setattr(importlib.import_module("ray.util.placement_group"), "placement_group",
                        lambda bundles, strategy: ("pg", strategy))
    monkeypatch.setattr(rollout_group, "RolloutGroup", engines)
    monkeypatch.setattr(training_group.TrainingRanks, "for_policy", staticmethod(ranks))
    config = _config(f"run_dir={tmp_path}", "cluster.in_process=never", "rollout.num_engines=2")
    cluster.start_workers(config)
    assert seen["rank_gpus"] == 0.9 and config.cluster.gpus_per_rank == 1  # the run's config is left as it is
    assert [(env["CUDA_VISIBLE_DEVICES"], env["VLLM_RAY_BUNDLE_INDICES"], env["VLLM_RAY_PER_WORKER_GPUS"])
            for env in seen["env"]] == [("3", "0", "0.1"), ("5", "1", "0.1")]

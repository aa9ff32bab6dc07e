"""Colocated vLLM / SGLang engines run on the GPUs of the training ranks they share
(``rlmega.trainer.engine_devices``): the mapping by hand, its refusals, and, in a Ray that declares GPUs
this machine does not have, that a rank reports the devices Ray gave it and an engine actor with no GPU
of its own sees exactly the devices it is given."""

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.engine_devices import EnginePlace, colocated_engine_places


def _ranks(*layout: tuple[str, str]) -> list[dict]:
    return [{"rank": rank, "node_id": node, "gpus": gpus} for rank, (node, gpus) in enumerate(layout)]


TWO_NODES = _ranks(*[("a", str(gpu)) for gpu in range(4)], *[("b", str(gpu)) for gpu in range(4)])


def test_engines_take_their_ranks_devices_in_order():
    places = colocated_engine_places(TWO_NODES, 4, 2)
    assert places == [EnginePlace(0, "0,1"), EnginePlace(2, "2,3"), EnginePlace(4, "0,1"), EnginePlace(6, "2,3")]
    assert places[2].env() == {"CUDA_VISIBLE_DEVICES": "0,1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert [p.visible_devices for p in colocated_engine_places(TWO_NODES, 8, 1)] == ["0", "1", "2", "3"] * 2
    assert colocated_engine_places(TWO_NODES, 2, 4) == [EnginePlace(0, "0,1,2,3"), EnginePlace(4, "0,1,2,3")]


def test_an_engine_across_two_nodes_is_refused_naming_its_ranks():
    with pytest.raises(UserError, match=r"colocated rollout engine 1 would span training ranks \[3, 4, 5\] on 2 nodes"
                                        r".*divide the training ranks per node"):
        colocated_engine_places(TWO_NODES, 2, 3)


def test_an_engine_larger_than_the_world_is_refused():
    with pytest.raises(UserError, match="needs rollout.tensor_parallel_size x data_parallel_size = 16 GPUs, but there "
                                        "are only 8 training ranks"):
        colocated_engine_places(TWO_NODES, 1, 16)


def test_ranks_sharing_one_gpu_cannot_host_an_engine_of_two():
    halves = _ranks(("a", "0"), ("a", "0"), ("a", "1"), ("a", "1"))  # cluster.gpus_per_rank=0.5
    assert [p.visible_devices for p in colocated_engine_places(halves, 2, 1)] == ["0", "0"]
    with pytest.raises(UserError, match=r"engine 0 needs 2 GPUs, but training ranks \[0, 1\] hold 1 \(0\): give each "
                                        r"rank a whole GPU \(cluster.gpus_per_rank=1\)"):
        colocated_engine_places(halves, 2, 2)


@pytest.fixture
def ray_with_gpus():
    """A private Ray that declares two GPUs (none is needed: Ray only names them to the actors)."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ranks_report_their_devices_and_engines_see_the_ones_they_share(ray_with_gpus, tmp_path, tiny_assets):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlmega.trainer.rollout_group import RolloutGroup
    from rlmega.trainer.training_group import RankProcess

    ray = ray_with_gpus
    ranks = [ray.remote(RankProcess).options(num_cpus=0, num_gpus=1).remote(rank, 2) for rank in (1, 1)]
    reported = sorted(ray.get(rank.address.remote(), timeout=120)[3] for rank in ranks)
    assert reported == ["0", "1"]  # each rank, the device Ray gave it
    for rank in ranks:
        ray.kill(rank)

    assets = tiny_assets(num_train=16, num_val=8)
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", f"model.path={assets / 'model'}",
                                      f"data.files=[{assets / 'train.parquet'}]",
                                      f"val_data.files=[{assets / 'val.parquet'}]",
                                      "rollout.num_engines=2", "rollout.cpus_per_engine=0.5"], check=False)
    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="PACK")
    ray.get(group.ready(), timeout=120)
    places = [EnginePlace(0, "1"), EnginePlace(1, "0,1")]
    # Ray 2.40 set CUDA_VISIBLE_DEVICES="" for every actor without a GPU; the installed Ray does so where asked to
    older_ray = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    engines = RolloutGroup(config, lambda i: PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                           env=lambda i: {**places[i].env(), **older_ray})
    try:
        engines.wait_started()
        # Ray gave these actors no GPU, and left them the devices they were given; placement.json records them
        assert [node["gpus"] for node in engines.nodes] == ["1", "0,1"]
    finally:
        engines.shutdown()
        remove_placement_group(group)

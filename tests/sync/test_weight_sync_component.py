"""A run's ``WeightSync`` on TP=2 ranks: its transport chosen once at construction and kept for every push, the
engines' own record of the version, the post-sync check as its own part, and one sync per set of engines."""

import pytest
import torch

from rlmega.bridge import load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.rollout import HFEngine
from rlmega.sync import StaleWeightsError, SyncConfig, WeightSync

PROMPTS = [[5, 17, 42, 8], [3, 99, 64]]


def _two_engines_two_pushes(rank, world_size, hf_dir):
    import rlmega.sync.weight_sync as weight_sync

    initialize(ParallelLayout(tp=2, world_size=2))
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, ParallelLayout(tp=2, world_size=2))
    load_hf_weights(chunks, spec, hf_dir)
    engines = [HFEngine(hf_dir), HFEngine(hf_dir)] if rank == 0 else None
    made = []
    real_make = weight_sync.make_transport
    weight_sync.make_transport = lambda *args, **kwargs: made.append(real_make(*args, **kwargs)) or made[-1]
    try:
        sync = WeightSync.build(SyncConfig(transport="auto", bucket_bytes=32 * 1024), chunks, spec, engines, atol=1e-4)
    finally:
        weight_sync.make_transport = real_make
    results = {"transport": sync.transport.name}
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.mul_(1.01)
    stats = [sync.push(version) for version in (1, 2)]
    results["stats"] = [(s.version, s.transport, s.tensors > 0) for s in stats]
    results["made"] = len(made)
    results["kept"] = engines is None or sync.transport.buckets is made[0]
    results["versions"] = [engine.weight_version() for engine in engines] if engines else None
    results["worst"] = sync.check(PROMPTS, 2)
    try:
        sync.check(PROMPTS, 3)
    except StaleWeightsError as error:
        results["stale"] = str(error)
    sync.close()
    destroy()
    return results


@pytest.mark.timeout(240)
def test_the_transport_is_chosen_once_and_the_engines_keep_the_version(start_dir):
    sender, other = run_on_ranks(_two_engines_two_pushes, 2, timeout_s=180, args=(str(start_dir),))
    assert sender["transport"] == "in_process"  # auto: engine objects in the sending process
    assert sender["made"] == 1 and sender["kept"]  # chosen at construction, kept for both pushes
    assert other["made"] == 0  # only the sending rank holds a bucket transport
    assert sender["stats"] == [(1, "in_process", True), (2, "in_process", True)]
    assert other["stats"] == [(1, None, False), (2, None, False)]  # the other rank exports, and sends nothing
    assert sender["versions"] == [2, 2]
    for result in (sender, other):  # every rank reaches the same verdicts
        assert result["worst"] <= 1e-4
        assert "serves weight version 2, expected version 3" in result["stale"]


def test_the_config_alone_says_what_its_transport_needs():
    assert SyncConfig(transport="sharded_rdt").engine_arguments() == {"weight_transfer": "sharded_rdt"}
    assert SyncConfig(transport="broadcast").engine_arguments() == {}
    assert SyncConfig(transport="sharded_rdt").problems("vllm", restarts_engines=False) == []
    keys = [key for key, _ in SyncConfig(transport="sharded_rdt").problems("sglang", restarts_engines=True)]
    assert keys == ["sync.transport", "rollout.restart_dead_engines"]
    assert [key for key, _ in SyncConfig(transport="pigeon").problems("hf", restarts_engines=False)] == ["sync.transport"]

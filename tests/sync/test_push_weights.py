"""push_weights from TP=2 Megatron ranks through each transport, with versions and the post-sync check."""

import pytest
import torch.distributed as dist

from rlmega.bridge import load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.rollout import HFEngine
from rlmega.sync import StaleWeightsError, TransportError, post_sync_check, push_weights
from rlmega.parallel.spawn import run_on_ranks
from rollout.tiny_models import checkpoint_tensors

from .helpers import BUCKET_BYTES

PROMPTS = [[5, 17, 42, 8], [3, 99, 64]]
CALL_TIMEOUT_S = 60


class _BreaksAfter:
    """An in-process engine that fails after writing ``num_good`` tensors of an update."""

    def __init__(self, engine: HFEngine, num_good: int):
        self.engine, self.num_good = engine, num_good

    def update_weights(self, named_tensors, version):
        def breaking():
            for index, item in enumerate(named_tensors):
                if index == self.num_good:
                    raise OSError("engine lost its device")
                yield item

        self.engine.update_weights(breaking(), version)


def _push_through_each_transport(rank, world_size, start_dir, target_dir):
    initialize(ParallelLayout(tp=2, world_size=2))
    spec = model_spec_from_hf(target_dir)
    chunks = build_chunks(spec, ParallelLayout(tp=2, world_size=2))
    load_hf_weights(chunks, spec, target_dir)
    results = {}

    remote = None
    if rank == 0:
        import ray

        from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor

        ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=100 * 1024**2, log_to_driver=False)
        remote = RemoteEngine(start_engine_actor(start_dir, attn_implementation="eager"), bucket_bytes=BUCKET_BYTES)
    for version, name in enumerate(["object_store", "shared_memory", "broadcast"], start=1):
        if rank == 0:  # back to the start weights, so each transport has to bring the trained ones
            remote.update_weights(checkpoint_tensors(start_dir).items(), version=version)
        stats = push_weights(chunks, spec, remote, version, bucket_bytes=BUCKET_BYTES, transport=name,
                             timeout_s=CALL_TIMEOUT_S)
        results[name] = (stats.transport, stats.tensors, post_sync_check(chunks, spec, remote, PROMPTS, version=version))
    try:
        post_sync_check(chunks, spec, remote, PROMPTS, version=4)
    except StaleWeightsError as error:
        results["stale"] = str(error)

    # A transport failure on the engine's rank: that rank raises, and still runs the export to its
    # end, so the other rank is not left in a collective and the next sync works.
    local = HFEngine(start_dir, attn_implementation="eager") if rank == 0 else None
    try:
        push_weights(chunks, spec, _BreaksAfter(local, 5) if rank == 0 else None, 5, bucket_bytes=BUCKET_BYTES,
                     timeout_s=CALL_TIMEOUT_S)
        results["failed"] = None
    except TransportError as error:
        results["failed"] = str(error)
        results["ready_after_failure"] = local.health()["ready"]
    dist.barrier()
    push_weights(chunks, spec, local, 6, bucket_bytes=BUCKET_BYTES, timeout_s=CALL_TIMEOUT_S)
    results["recovered"] = post_sync_check(chunks, spec, local, PROMPTS, version=6)
    if rank == 0:
        import ray

        ray.shutdown()
    destroy()
    return results


@pytest.mark.timeout(240)
def test_push_weights_through_each_transport_and_recover_from_a_failed_one(start_dir, target_dir):
    engine_rank, other_rank = run_on_ranks(_push_through_each_transport, 2, timeout_s=230,
                                           args=(str(start_dir), str(target_dir)))
    num_tensors = len(checkpoint_tensors(target_dir))
    for name in ["object_store", "shared_memory", "broadcast"]:
        transport, tensors, worst = engine_rank[name]
        assert (transport, tensors) == (name, num_tensors) and worst <= 1e-4
        assert other_rank[name][:2] == (None, 0) and other_rank[name][2] <= 1e-4
    for result in (engine_rank, other_rank):
        assert "serves weight version 3, expected version 4" in result["stale"]
        assert result["recovered"] <= 1e-4
    assert "engine 0 failed while receiving weights: OSError('engine lost its device')" in engine_rank["failed"] and engine_rank["ready_after_failure"] is False
    assert other_rank["failed"] is None

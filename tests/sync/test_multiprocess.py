"""Cross-process transports between real processes: one sending rank and two engine processes."""

import pytest
import torch.distributed as dist

from rlmega.rollout import HFEngine
from rlmega.sync import make_transport
from rlmega.parallel.spawn import run_on_ranks

from .helpers import BUCKET_BYTES, buckets_of, send_all


def _one_sender_two_engines(rank, world_size, start_dir, target_dir):
    """Rank 0 sends; ranks 1 and 2 each iterate their receiver into their own engine. The test's
    own gloo world only hands the receivers out; each transport builds its own channel (and group).
    Version 1 carries the target weights by broadcast, version 2 the start weights by shared memory."""
    engine = HFEngine(start_dir, attn_implementation="eager") if rank else None
    results = []
    for version, (name, directory) in enumerate([("broadcast", target_dir), ("shared_memory", start_dir)], start=1):
        if rank == 0:
            transport = make_transport(name, [], bucket_bytes=BUCKET_BYTES, timeout_s=60)
            dist.broadcast_object_list([transport.listen(world_size - 1)], src=0)
            send_all(transport, buckets_of(directory))
            continue
        holder = [None]
        dist.broadcast_object_list(holder, src=0)
        engine.update_weights(holder[0][rank - 1], version=version)
        state = engine.model.state_dict()
        differing = sorted(n for n, t in sum(buckets_of(directory), []) if not state[n].equal(t))
        results.append((name, engine.weight_version(), differing))
    return results


@pytest.mark.timeout(180)
def test_one_sender_feeds_two_engine_processes_bit_identically(start_dir, target_dir):
    results = run_on_ranks(_one_sender_two_engines, 3, timeout_s=170, args=(str(start_dir), str(target_dir)))
    expected = [("broadcast", 1, []), ("shared_memory", 2, [])]
    assert results == [[], expected, expected]

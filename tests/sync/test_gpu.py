"""GPU paths: shared memory through CUDA IPC, and the broadcast transport over NCCL. Skipped without CUDA."""

import pytest
import torch
import torch.distributed as dist

from rlmega.rollout import HFEngine
from rlmega.sync import make_transport
from rlmega.parallel.spawn import run_on_ranks

from .helpers import BUCKET_BYTES, buckets_of, send_all


def _cuda_sender_and_engine(rank, world_size, name, start_dir, target_dir):
    """Rank 0 sends CUDA buckets; rank 1 runs an engine on its GPU and receives into it."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    if rank == 0:
        transport = make_transport(name, [], bucket_bytes=BUCKET_BYTES, timeout_s=60)
        dist.broadcast_object_list([transport.listen(1)], src=0)
        send_all(transport, [[(n, t.cuda()) for n, t in bucket] for bucket in buckets_of(target_dir)])
        return None
    holder = [None]
    dist.broadcast_object_list(holder, src=0)
    engine = HFEngine(start_dir, device="cuda", attn_implementation="eager")
    engine.update_weights(holder[0][0], version=1)
    state = engine.model.state_dict()
    differing = sorted(n for bucket in buckets_of(target_dir) for n, t in bucket if not state[n].cpu().equal(t))
    return engine.weight_version(), differing


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_shared_memory_moves_cuda_buckets_through_cuda_ipc(start_dir, target_dir):
    """Both processes on one GPU: the region is device memory shared by CUDA IPC."""
    results = run_on_ranks(_cuda_sender_and_engine, 2, timeout_s=170, args=("shared_memory", str(start_dir), str(target_dir)))
    assert results[1] == (1, [])


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_broadcast_over_nccl_between_two_gpus(start_dir, target_dir):
    """NCCL refuses two ranks on one GPU, so this needs two."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL does not run two ranks of one group on the same GPU")
    results = run_on_ranks(_cuda_sender_and_engine, 2, timeout_s=170, args=("broadcast", str(start_dir), str(target_dir)))
    assert results[1] == (1, [])

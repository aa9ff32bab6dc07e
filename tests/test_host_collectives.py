"""Collectives through shared memory for ranks on one host: the same results as gloo, bit for bit where gloo's
order of summation is the same (two ranks) and exactly the rank-order sum otherwise; a late rank is named; a
group that cannot share memory keeps gloo; nothing is left in /dev/shm."""

import os
import uuid

import pytest
import torch
import torch.distributed as dist

from rlmega.parallel import cpu_platform, host_collectives
from rlmega.parallel.host_collectives import HostCollectives
from rlmega.parallel.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not host_collectives.supported(), reason="shared-memory collectives need x86-64 Linux")

# Shapes, dtypes and ops in one sequence, so that the two alternating slot sets are reused many times over
# with tensors of different sizes, and a peer that runs ahead never overwrites what another still reads.
CASES = [((7,), torch.float32, "sum"), ((64, 33), torch.float32, "sum"), ((1,), torch.float64, "sum"),
         ((5, 3), torch.float32, "max"), ((200,), torch.bfloat16, "sum"), ((9,), torch.int64, "sum"),
         ((16, 16), torch.float32, "min"), ((3, 4, 5), torch.float32, "broadcast"), ((1024, 128), torch.float32, "sum"),
         ((2,), torch.int64, "broadcast")] * 3
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _input(rank: int, step: int, shape, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def _rank_order(size: int, step: int, shape, dtype, op: str) -> torch.Tensor:
    """What every rank must get: the inputs combined in rank order (or the source's tensor)."""
    if op == "broadcast":
        return _input(step % size, step, shape, dtype)
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    result = _input(0, step, shape, dtype)
    for rank in range(1, size):
        result = combine(result, _input(rank, step, shape, dtype))
    return result


def _compare_body(rank, world_size):
    host = HostCollectives.open(dist.group.WORLD, timeout_s=60)
    assert host is not None
    mismatches = []
    for step, (shape, dtype, op) in enumerate(CASES):
        mine = _input(rank, step, shape, dtype)
        gloo = mine.clone()
        if step % 4 == 1 and mine.dim() == 2:  # a non-contiguous tensor, reduced in place like any other
            mine = mine.t()
            gloo = gloo.t()
        if op == "broadcast":
            host.broadcast(mine, src=step % world_size)
            dist.broadcast(gloo, src=step % world_size)
        else:
            host.all_reduce(mine, OPS[op])
            dist.all_reduce(gloo, op=OPS[op])
        want = _rank_order(world_size, step, shape, dtype, op)
        if step % 4 == 1 and mine.dim() == 2:
            want = want.t()
        if not torch.equal(mine, want):
            mismatches.append(("rank order", step))
        if world_size == 2 and not torch.equal(mine, gloo):
            mismatches.append(("gloo", step))
    return mismatches, os.path.exists(host.path), host._sequence  # rank 0 is past open(), which unlinks it


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_equal_gloo_and_the_rank_order_sum(world_size):
    results = run_on_ranks(_compare_body, world_size, timeout_s=120)
    for mismatches, left, sequence in results:
        assert mismatches == []
        assert not left  # unlinked once every rank has mapped it
        assert sequence == len(CASES)


def _late_body(rank, world_size):
    host = HostCollectives.open(dist.group.WORLD, timeout_s=1.0)
    if rank == 1:
        dist.barrier()  # alive, busy elsewhere: never arrives
        return None
    try:
        host.all_reduce(torch.ones(3))
    except TimeoutError as error:
        return str(error)
    finally:
        dist.barrier()
    return "no error"


def test_a_rank_that_does_not_arrive_is_named():
    message = run_on_ranks(_late_body, 2, timeout_s=120)[0]
    assert "group rank(s) [1] did not arrive within 1 s" in message


def _unsupported_on_rank_one(rank, world_size):
    if rank == 1:
        host_collectives.supported = lambda nbytes=0: False  # as on a rank without the shared /dev/shm
    return HostCollectives.open(dist.group.WORLD, timeout_s=60) is None


def test_a_group_whose_ranks_cannot_share_memory_keeps_gloo():
    assert run_on_ranks(_unsupported_on_rank_one, 2, timeout_s=120) == [True, True]


def _routed_body(rank, world_size):
    cpu_platform.route_collectives([dist.group.WORLD], timeout_s=60)
    try:
        host = cpu_platform._HOST_GROUPS[dist.group.WORLD]
        small = torch.full((4,), float(rank + 1))
        handle = dist.all_reduce(small, async_op=True)  # Megatron waits on the handle later
        handle.wait()
        large = torch.full((host.slot_bytes // 4 + 1,), float(rank + 1))  # over a slot: through gloo
        dist.all_reduce(large)
        source = torch.arange(6.0) if rank == 1 else torch.zeros(6)
        dist.broadcast(source, src=1)
        product = torch.tensor([float(rank + 2)])
        dist.all_reduce(product, op=dist.ReduceOp.PRODUCT)  # an op it does not take: through gloo
        return small.tolist(), float(large[0]), float(large[-1]), source.tolist(), float(product), host._sequence
    finally:
        cpu_platform.unroute_collectives()
        assert dist.all_reduce is cpu_platform._gloo_all_reduce


def test_routed_groups_send_what_shared_memory_does_not_take_to_gloo():
    for small, large_first, large_last, source, product, sequence in run_on_ranks(_routed_body, 2, timeout_s=120):
        assert small == [3.0] * 4 and large_first == large_last == 3.0
        assert source == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and product == 6.0
        assert sequence == 2  # the small all-reduce and the broadcast; the large one and the product went to gloo


def _fail_to_map(rank, world_size, name):
    host_collectives.uuid.uuid4 = lambda: uuid.UUID(name)  # the region's name, known to the test
    if rank == 1:
        def refuse(*args, **kwargs):
            raise OSError("unable to mmap")
        host_collectives.map_region = refuse
    return HostCollectives.open(dist.group.WORLD, timeout_s=60) is None


def test_a_rank_that_cannot_map_the_region_leaves_the_group_on_gloo_and_nothing_in_dev_shm():
    name = uuid.uuid4()
    assert run_on_ranks(_fail_to_map, 2, timeout_s=120, args=(str(name),)) == [True, True]
    assert not os.path.exists(f"/dev/shm/rlmega-collectives-{name.hex}")


def _exited_body(rank, world_size):
    host = HostCollectives.open(dist.group.WORLD, timeout_s=600)
    if rank == 1:
        return None  # this rank's process ends here, without the collective rank 0 waits in
    try:
        host.all_reduce(torch.ones(3))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_rank_whose_process_exits_is_named_long_before_the_timeout():
    message = run_on_ranks(_exited_body, 2, timeout_s=120)[0]
    assert "group rank(s) [1] exited (pid" in message

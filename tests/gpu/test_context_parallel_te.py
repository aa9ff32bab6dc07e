"""transformer-engine's THD context-parallel split is the one the worker assumes. Needs CUDA and
transformer-engine (`pip install -e .[gpu]`); the CPU twin is tests/workers/test_context_parallel.py.

For THD micro-batches the worker gives each sequence a slot of a multiple of 2*cp tokens and keeps,
on CP rank r, the positions ``rlmega.workers.context_parallel.segment_positions`` lists; TE's
attention and Megatron's THD RoPE read the same positions through ``thd_get_partitioned_indices``.
"""

import pytest
import torch

from rlmega.workers.context_parallel import segment_positions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_partition_equals_transformer_engine(cp):
    tex = pytest.importorskip("transformer_engine_torch")
    slots = [4 * cp, 2 * cp, 6 * cp, 2 * cp]
    cu_seqlens_padded = torch.zeros(len(slots) + 1, dtype=torch.int32, device="cuda")
    cu_seqlens_padded[1:] = torch.cumsum(torch.tensor(slots, dtype=torch.int32, device="cuda"), dim=0)
    total = sum(slots)
    for rank in range(cp):
        theirs = tex.thd_get_partitioned_indices(cu_seqlens_padded, total, cp, rank)
        assert theirs.cpu().long().tolist() == segment_positions(slots, cp, rank).tolist()

"""The critic's gradient does not depend on the layout: under sequence parallelism (on by default at
tp > 1 on GPUs, set here) every TP rank computes the same value loss from the gathered values, so the value head's
backward must split, not sum, the values' gradient (a sum made it tp times too large)."""

import math

import pytest
import torch

from hf_models import save_tiny_model
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import CriticLossConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


def _grad_norm_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    config = WorkerConfig(role="critic", critic_loss=CriticLossConfig(cliprange_value=None),
                          sequence_parallel=layout.tp > 1)  # on CPU a dense model's default is off
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    with torch.no_grad():  # a known non-zero head, so the trunk gets a gradient too
        for param in (p for chunk in worker.chunks for p in chunk.parameters() if getattr(p, "is_value_head", False)):
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(8)))
    batch = make_batch()
    generator = torch.Generator().manual_seed(4)
    returns = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    metrics = worker.update(batch.with_fields(values=worker.compute_values(batch), returns=returns))
    destroy()
    return metrics["critic/grad_norm"]


def test_critic_gradient_is_the_same_with_sequence_parallelism(llama):
    [one_rank] = run_on_ranks(_grad_norm_body, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=1), str(llama)))
    for grad_norm in run_on_ranks(_grad_norm_body, 2, timeout_s=TIMEOUT_S, args=(ParallelLayout(tp=2, world_size=2), str(llama))):
        assert math.isclose(grad_norm, one_rank, rel_tol=1e-5), (grad_norm, one_rank)

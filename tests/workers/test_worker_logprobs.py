"""The worker's log-probs and entropies equal the HF model's, in every layout, packed or padded."""

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, WorkerConfig
from rlmega.workers.forward import sequence_logprobs
from rlmega.workers.worker import MegatronWorker
from worker_cases import hf_logprobs, make_batch

ATOL = 1e-4  # fp32 on CPU: the acceptance bound against HF
TIMEOUT_S = 240


def _logprobs_body(rank, world_size, layout, hf_dir, packing, budget):
    initialize(layout)
    config = WorkerConfig(role="ref", batching=BatchingConfig(packing=packing, max_tokens_per_microbatch=budget))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    result = worker.compute_logprobs(make_batch())
    # The post-sync check's scorer: every token after the first, one sequence at a time.
    whole = sequence_logprobs(worker.chunks, worker.spec, make_batch().tokens) if packing else None
    destroy()
    return result, whole


CASES = {
    "tp1": ("llama", dict(world_size=1)),
    "tp2": ("llama", dict(tp=2, world_size=2)),
    "pp2": ("llama", dict(pp=2, world_size=2)),
    "dp2": ("llama", dict(world_size=2)),
    "ep2-moe": ("qwen3-moe", dict(ep=2, world_size=2)),
    "cp2": ("llama", dict(cp=2, world_size=2)),
    "tp2-cp2": ("llama", dict(tp=2, cp=2, world_size=4)),
    "cp2-mla": ("deepseek-v3", dict(cp=2, world_size=2)),  # MLA's own RoPE and head sizes under CP
}


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_match_hf(checkpoints, case, packing):
    model, layout_args = CASES[case]
    layout = ParallelLayout(**layout_args)
    batch = make_batch()
    expected_logp, expected_entropy = hf_logprobs(checkpoints[model], batch)
    results = run_on_ranks(_logprobs_body, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(checkpoints[model]), packing, 20))
    expected_whole, _ = hf_logprobs(checkpoints[model], SequenceBatch(batch.tokens, [1] * len(batch)))
    for (logp, entropy), whole in results:  # every rank gets the whole batch's results
        if whole is not None:
            for got, want in zip(whole, expected_whole):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert [t.shape for t in logp] == [t.shape for t in expected_logp]
        for got, want in zip(logp, expected_logp):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for got, want in zip(entropy, expected_entropy):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

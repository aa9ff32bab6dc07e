"""Log-probs under the sampling temperature: responses the hf engine sampled at T are scored by the
worker under softmax(z / T), and equal the engine's own log-probs; the post-sync check still passes."""

import pytest
import torch
import torch.distributed as dist

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import WorkerConfig
from rlmega.workers.worker import MegatronWorker

ATOL = 1e-5  # fp32 on CPU
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [64, 2, 31, 8, 8, 20, 9]]


def _body(rank, world_size, layout, hf_dir, temperature):
    from rlmega.rollout.hf_engine import HFEngine
    from rlmega.rollout.protocol import SamplingParams
    from rlmega.sync import post_sync_check

    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, WorkerConfig(role="ref"), hf_dir=hf_dir)
    engine = HFEngine(hf_dir) if rank == 0 else None
    payload = [None]
    if rank == 0:
        generations = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=6, n=2, seed=3))
        payload = [[(PROMPTS[g.prompt_index], g.response_token_ids, g.logprobs) for g in generations]]
    dist.broadcast_object_list(payload, src=0)
    samples = payload[0]
    tokens = [torch.tensor(prompt + response) for prompt, response, _ in samples]
    prompt_lengths = [len(prompt) for prompt, _, _ in samples]
    tempered, _ = worker.compute_logprobs(SequenceBatch(tokens, prompt_lengths, temperature=temperature))
    raw, _ = worker.compute_logprobs(SequenceBatch(tokens, prompt_lengths))
    worst = post_sync_check(worker.chunks, worker.spec, engine, PROMPTS[:2], engine_rank=0)
    destroy()
    return [torch.tensor(lp) for _, _, lp in samples], tempered, raw, worst


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_trainer_logprobs_equal_the_engines_sampling_logprobs(checkpoints, temperature):
    layout = ParallelLayout(tp=2, world_size=2)  # the temperature applies to each vocabulary shard
    for engine_logp, tempered, raw, worst in run_on_ranks(_body, 2, timeout_s=240,
                                                          args=(layout, str(checkpoints["llama"]), temperature)):
        for want, got, untempered in zip(engine_logp, tempered, raw):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # Without the temperature the trainer would score another policy: far beyond the tolerance.
        assert max((u - w).abs().max() for u, w in zip(raw, engine_logp)) > 100 * ATOL
        assert worst < 1e-3

"""The supervised step trains only the tokens its ``response_mask`` keeps (an agent's demonstrated turns, not the
tool output between them): the loss is the mean NLL of the kept tokens, and a token masked out changes nothing."""

import pytest
import torch

from hf_models import VOCAB
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import OptimizerConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import hf_logprobs, make_batch

TIMEOUT_S = 300


def _masks(batch):
    """Keep every response token but the last of each sequence and the second of the first."""
    masks = []
    for index, length in enumerate(batch.response_lengths):
        mask = torch.ones(length)
        mask[-1] = 0.0
        if index == 0:
            mask[1] = 0.0
        masks.append(mask)
    return masks


def _body(rank, world_size, layout, hf_dir, batches):
    results = []
    for batch in batches:  # each from the checkpoint's weights, with a fresh optimizer
        initialize(layout)
        worker = MegatronWorker(model_spec_from_hf(hf_dir), layout,
                                WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, lr_schedule="constant")),
                                hf_dir=hf_dir)
        metrics = worker.sft_step(batch, 1e-2)
        results.append((metrics, {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}))
        destroy()
    return results


def test_sft_trains_only_the_masked_in_tokens(checkpoints):
    hf_dir = str(checkpoints["llama"])
    batch = make_batch()
    masks = _masks(batch)
    masked = batch.with_fields(response_mask=masks)
    # The same batch with every masked-out last token replaced: nothing after it conditions on it.
    changed_tokens = [tokens.clone() for tokens in batch.tokens]
    for tokens in changed_tokens:
        tokens[-1] = (tokens[-1] + 1) % VOCAB
    changed = type(batch)(changed_tokens, batch.prompt_lengths).with_fields(response_mask=masks)
    layout = ParallelLayout(tp=2, world_size=2)
    (first, weights), (second, changed_weights), (unmasked, unmasked_weights) = run_on_ranks(
        _body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, hf_dir, [masked, changed, batch]))[0]
    logprobs, _ = hf_logprobs(hf_dir, batch)
    kept = torch.cat([logp * mask for logp, mask in zip(logprobs, masks)]).sum() / sum(m.sum() for m in masks)
    assert first["sft_loss"] == pytest.approx(float(-kept), rel=1e-5)
    everything = torch.cat(logprobs).mean()
    assert unmasked["sft_loss"] == pytest.approx(float(-everything), rel=1e-5)
    for name, tensor in weights.items():
        torch.testing.assert_close(changed_weights[name], tensor, rtol=0, atol=1e-7, msg=name)
    assert any(not torch.allclose(unmasked_weights[name], tensor, atol=1e-6) for name, tensor in weights.items())

"""A Qwen2.5-VL actor on Megatron workers: log-probs of responses to image prompts equal transformers' (images of
different sizes, several per micro-batch, packed and padded, at TP2 with sequence parallelism and at PP2); an update
trains the language model and leaves the vision tower fixed unless ``freeze_vision`` is off."""

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.data.schema import ImageInputs
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, OptimizerConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from vl_models import hf_logits, save_tiny_vl, vl_cases

TIMEOUT_S = 300
LOGPROB_ATOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model = save_tiny_vl(directory)
    generator = torch.Generator().manual_seed(8)
    tokens, prompts, images, references = [], [], [], []
    for ids, pixels, grid in vl_cases():  # each prompt answered by a random response of 3..6 tokens
        response = torch.randint(3, 140, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
        sequence = torch.cat([ids[0], response])
        logits = hf_logits(model, sequence.unsqueeze(0), pixels, grid)
        logp = torch.log_softmax(logits[ids.shape[1] - 1:-1], dim=-1).gather(-1, response.unsqueeze(-1))[:, 0]
        tokens.append(sequence)
        prompts.append(ids.shape[1])
        images.append(None if pixels is None else ImageInputs(pixels, grid))
        references.append(logp)
    return directory, SequenceBatch(tokens, prompts, images=images), references


def _body(rank, world_size, layout, hf_dir, batch, packing, freeze_vision):
    initialize(layout)
    config = WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, lr_schedule="constant"),
                          batching=BatchingConfig(max_tokens_per_microbatch=60, packing=packing),
                          freeze_vision=freeze_vision,
                          sequence_parallel=layout.tp > 1)  # the image features' scatter over the sequence slices
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    before = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[world_size - 1])}
    logprobs, _ = worker.compute_logprobs(batch)
    advantages = [torch.ones(n) for n in batch.response_lengths]
    metrics = worker.update(batch.with_fields(old_logp=logprobs, advantages=advantages))
    after = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[world_size - 1])}
    destroy()
    return logprobs, metrics, before, after


CASES = {
    "tp2-packed": (dict(tp=2), True),
    "tp2-padded": (dict(tp=2), False),
    "pp2-packed": (dict(pp=2), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_of_image_prompts_equal_transformers_and_the_tower_stays_frozen(vl_checkpoint, case):
    directory, batch, references = vl_checkpoint
    layout_args, packing = CASES[case]
    layout = ParallelLayout(world_size=2, **layout_args)
    logprobs, metrics, before, after = run_on_ranks(
        _body, 2, timeout_s=TIMEOUT_S, args=(layout, str(directory), batch, packing, True))[-1]
    for got, want in zip(logprobs, references):
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    assert metrics["actor/skipped_steps"] == 0
    vision = [name for name in before if name.startswith("visual.")]
    assert vision and all(torch.equal(after[name], before[name]) for name in vision)
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])


def test_an_unfrozen_tower_trains(vl_checkpoint):
    directory, batch, _ = vl_checkpoint
    layout = ParallelLayout(world_size=2, tp=2)
    _, _, before, after = run_on_ranks(_body, 2, timeout_s=TIMEOUT_S, args=(layout, str(directory), batch, True, False))[-1]
    assert not torch.equal(after["visual.merger.mlp.0.weight"], before["visual.merger.mlp.0.weight"])
    assert not torch.equal(after["visual.blocks.0.attn.qkv.weight"], before["visual.blocks.0.attn.qkv.weight"])

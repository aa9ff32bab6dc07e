"""The actor's loss with on-policy distillation's top-k term: the term the worker reports equals one computed from
the HF model's logits, and one update gives the same weights on one rank, split over the vocabulary (TP2) and
split along the sequence (CP2)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_models import VOCAB
from rlmega.algos.distill import DistillConfig, top_k_reverse_kl
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

K, COEF, TEMPERATURE = 6, 0.5, 0.7
TIMEOUT_S = 300


def _distilled_batch():
    """A batch whose advantages are 0 (the policy loss gives no gradient) with a teacher's top-k at every token."""
    generator = torch.Generator().manual_seed(11)
    batch = make_batch()
    batch.temperature = TEMPERATURE
    lengths = batch.response_lengths
    ids = [torch.stack([torch.randperm(VOCAB, generator=generator)[:K] for _ in range(n)]) for n in lengths]
    teacher = [torch.log_softmax(torch.randn(n, K, generator=generator), -1) - 0.5 for n in lengths]
    fields = dict(advantages=[torch.zeros(n) for n in lengths], teacher_topk_ids=ids, teacher_topk_logp=teacher)
    return batch.with_fields(**fields), DistillConfig(coef=COEF, estimator="top_k", top_k=K)


def _update_body(rank, world_size, layout, hf_dir):
    import dataclasses

    initialize(layout)
    config = WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant"),
                          batching=BatchingConfig(max_tokens_per_microbatch=1000, min_microbatches=2),
                          policy_loss=PolicyLossConfig(name="ppo"))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    batch, distill = _distilled_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    metrics = worker.update(dataclasses.replace(batch.with_fields(old_logp=old_logp), distill=distill))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return metrics, weights


def _hf_top_k_kl(hf_dir) -> float:
    """The mean per-token term over the batch, from the HF model's tempered full softmax."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    batch, _ = _distilled_batch()
    terms = []
    with torch.no_grad():
        for tokens, prompt, ids, teacher in zip(batch.tokens, batch.prompt_lengths, batch.fields["teacher_topk_ids"],
                                                batch.fields["teacher_topk_logp"]):
            logp = torch.log_softmax(model(tokens.unsqueeze(0)).logits[0, prompt - 1:-1] / TEMPERATURE, dim=-1)
            terms.append(top_k_reverse_kl(logp.gather(-1, ids), teacher))
    return float(torch.cat(terms).mean())


@pytest.fixture(scope="module")
def single_rank(checkpoints):
    layout = ParallelLayout(world_size=1)
    return run_on_ranks(_update_body, 1, timeout_s=TIMEOUT_S, args=(layout, str(checkpoints["llama"])))[0]


def test_the_top_k_term_is_the_hf_models_and_trains(checkpoints, single_rank):
    metrics, weights = single_rank
    expected = _hf_top_k_kl(checkpoints["llama"])
    assert expected > 0.05
    assert metrics["distill/top_k_kl"] == pytest.approx(expected, rel=1e-5)
    assert metrics["distill/top_k_loss_term"] == pytest.approx(COEF * expected, rel=1e-5)
    assert metrics["actor/pg_loss"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])
    from safetensors.torch import load_file

    original = load_file(str(checkpoints["llama"] / "model.safetensors"))
    assert any(not torch.equal(tensor, original[name]) for name, tensor in weights.items())  # the term alone trains


@pytest.mark.parametrize("layout_args", [dict(tp=2, world_size=2), dict(cp=2, world_size=2)], ids=["tp2", "cp2"])
def test_split_layouts_give_the_single_ranks_update(checkpoints, single_rank, layout_args):
    layout = ParallelLayout(**layout_args)
    metrics, weights = run_on_ranks(_update_body, layout.world_size, timeout_s=TIMEOUT_S,
                                    args=(layout, str(checkpoints["llama"])))[0]
    reference_metrics, reference_weights = single_rank
    assert metrics["distill/top_k_kl"] == pytest.approx(reference_metrics["distill/top_k_kl"], rel=1e-5)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference_weights[name], rtol=0, atol=1e-5, msg=name)

"""The LM head's response-row logits (``rlmega.workers.lm_head``) give the same log-probs, entropies
and optimizer step as Megatron's full output layer, at one rank and at TP2 with sequence parallelism
(where rank 1's slice of the padded vocabulary holds no real token)."""

import pytest
import torch

from rlmega.models import model_spec_from_hf, padded_vocab_size
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import OptimizerConfig, PolicyLossConfig, WorkerConfig
from worker_cases import make_batch

TIMEOUT_S = 300


def _body(rank, world_size, layout, hf_dir, rows_only):
    from rlmega.workers import lm_head
    from rlmega.workers.worker import MegatronWorker

    if not rows_only:  # Megatron's own output layer: every position, every padded column
        lm_head.install = lambda model, vocab_size: False
    initialize(layout)
    config = WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant"),
                          policy_loss=PolicyLossConfig(name="ppo", entropy_coeff=0.01),
                          sequence_parallel=layout.tp > 1)  # on CPU a dense model's default is off
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    chunk = worker.chunks[-1]
    shapes = []
    layer = lm_head.response_logits_layer(chunk)
    if layer is not None:
        layer.register_forward_hook(lambda module, args, output: shapes.append(tuple(output[0].shape)))
    batch = make_batch()
    logp, entropy = worker.compute_logprobs(batch)
    generator = torch.Generator().manual_seed(3)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    metrics, fused_logp, _ = worker.update_on_policy(batch.with_fields(advantages=advantages))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return dict(logp=logp, entropy=entropy, fused_logp=fused_logp, grad_norm=metrics["actor/grad_norm"],
                weights=weights, shapes=shapes, installed=layer is not None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout_args", [dict(world_size=1), dict(tp=2, world_size=2)], ids=["tp1", "tp2-sp"])
def test_response_rows_equal_the_full_output_layer(checkpoints, layout_args):
    layout = ParallelLayout(**layout_args)
    hf_dir = str(checkpoints["llama"])
    full, rows = (run_on_ranks(_body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, hf_dir, rows_only))
                  for rows_only in (False, True))
    assert not any(result["installed"] for result in full) and all(result["installed"] for result in rows)

    vocab = model_spec_from_hf(hf_dir).vocab_size
    width = padded_vocab_size(vocab, layout.tp) // layout.tp
    responses = sum(make_batch().response_lengths)
    for rank, result in enumerate(rows):  # [N response rows, 1, this rank's real columns]
        real = max(0, min(width, vocab - rank * width))
        assert result["shapes"] and all(shape == (responses, 1, real) for shape in result["shapes"]), result["shapes"]
    if layout.tp == 2:
        assert rows[1]["shapes"][0][-1] == 0  # the test model's vocabulary fits in rank 0's slice

    full, rows = full[0], rows[0]
    for name in ("logp", "entropy", "fused_logp"):
        for got, want in zip(rows[name], full[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert rows["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-6)
    assert rows["weights"].keys() == full["weights"].keys()
    for name, tensor in full["weights"].items():
        torch.testing.assert_close(rows["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)

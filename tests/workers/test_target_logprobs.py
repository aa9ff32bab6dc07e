"""Log-probs of several targets per row from vocabulary-parallel logits, and the top-k distillation loss built
on them: values and gradients equal a direct full-softmax computation, on one rank and split over two."""

import pytest
import torch
import torch.distributed as dist

from rlmega.algos.distill import top_k_distill_loss
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.target_logprobs import vocab_parallel_target_logprobs

VOCAB, PADDED, TOKENS, K = 50, 64, 11, 5
ROWS = (3, 4)  # [B, T] = the TOKENS positions plus one masked slot
COEF = 0.7


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(TOKENS, PADDED, generator=generator)
    logits[:, VOCAB:] = 1e4  # padding columns: a leak would dominate everything
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:K] for _ in range(TOKENS)])
    teacher = torch.log_softmax(2 * torch.randn(TOKENS, VOCAB, generator=generator), -1).gather(-1, ids)
    weights = torch.randn(TOKENS, K, generator=generator)
    return logits, ids, teacher, weights


def _reference_logprobs(logits, ids, weights):
    """Full-vocabulary fp64 log_softmax at the ids, with autograd gradients of ``sum(weights * logp)``."""
    z = logits[:, :VOCAB].double().requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1).gather(-1, ids)
    (logp * weights).sum().backward()
    grad = torch.zeros(TOKENS, PADDED, dtype=torch.float64)
    grad[:, :VOCAB] = z.grad
    return logp.detach(), grad


def _ours(logits, ids, weights, **kwargs):
    logits = logits.clone().requires_grad_(True)
    logp = vocab_parallel_target_logprobs(logits, ids, vocab_size=VOCAB, **kwargs)
    (logp * weights).sum().backward()
    return logp.detach(), logits.grad


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_target_logprobs_match_full_softmax(chunk_tokens):
    logits, ids, _, weights = _inputs()
    expected_logp, expected_grad = _reference_logprobs(logits, ids, weights)
    logp, grad = _ours(logits, ids, weights, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(logp.double(), expected_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=0, atol=1e-6)
    assert torch.count_nonzero(grad[:, VOCAB:]) == 0  # no gradient into padding columns


def test_bad_targets_are_named():
    shapes = r"expected logits \[N, V_local\] and targets \[N, k\], got \[3, 4\] and \[3\]"
    with pytest.raises(ValueError, match=shapes):
        vocab_parallel_target_logprobs(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), vocab_size=4)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 4\) \(the vocabulary\), got 0\.\.6"):
        vocab_parallel_target_logprobs(torch.zeros(2, 8), torch.tensor([[0, 6], [1, 2]]), vocab_size=4)


def _padded(flat):
    """``[TOKENS, ...]`` -> ``[3, 4, ...]`` with the last slot of the last row masked, and the mask."""
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[-1, -1] = False
    padded = flat.new_zeros(ROWS + flat.shape[1:])
    padded[mask] = flat
    return padded, mask


def _top_k_loss(logits, ids, teacher, **kwargs):
    """The loss through the vocabulary-parallel path and its gradient with respect to ``logits``."""
    logits = logits.clone().requires_grad_(True)
    student = vocab_parallel_target_logprobs(logits, ids, vocab_size=VOCAB, **kwargs)
    padded_student, mask = _padded(student)
    loss, metrics = top_k_distill_loss(padded_student, _padded(teacher)[0], mask, coef=COEF)
    loss.backward()
    return loss.detach(), metrics["top_k_kl"], logits.grad


def _direct_top_k_loss(logits, ids, teacher):
    """The same loss written out from the full softmax in fp32: each distribution renormalised over the k ids."""
    z = logits[:, :VOCAB].clone().requires_grad_(True)
    p = torch.softmax(z, dim=-1).gather(-1, ids)
    q_s = p / p.sum(-1, keepdim=True)
    q_t = teacher.exp() / teacher.exp().sum(-1, keepdim=True)
    loss = COEF * (q_s * (q_s.log() - q_t.log())).sum(-1).mean()
    loss.backward()
    grad = torch.zeros(TOKENS, PADDED)
    grad[:, :VOCAB] = z.grad
    return loss.detach(), grad


def test_top_k_loss_value_and_gradient_equal_the_full_softmax():
    logits, ids, teacher, _ = _inputs()
    loss, top_k_kl, grad = _top_k_loss(logits, ids, teacher, chunk_tokens=4)
    expected_loss, expected_grad = _direct_top_k_loss(logits, ids, teacher)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(top_k_kl, expected_loss / COEF, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    assert loss > 0.05 and grad.abs().max() > 1e-3  # a real signal, not two zeros


def _tensor_parallel(rank, world_size):
    logits, ids, teacher, weights = _inputs()
    local = PADDED // world_size
    shard = logits[:, rank * local:(rank + 1) * local]
    group = dict(vocab_start=rank * local, group=dist.group.WORLD, chunk_tokens=4)
    return _ours(shard, ids, weights, **group), _top_k_loss(shard, ids, teacher, **group)


def test_two_tensor_parallel_ranks_equal_one():
    logits, ids, teacher, weights = _inputs()
    logp, grad = _ours(logits, ids, weights, chunk_tokens=4)
    loss, top_k_kl, loss_grad = _top_k_loss(logits, ids, teacher, chunk_tokens=4)
    results = run_on_ranks(_tensor_parallel, 2, timeout_s=120)
    local = PADDED // 2
    for rank, ((rank_logp, rank_grad), (rank_loss, rank_kl, rank_loss_grad)) in enumerate(results):
        columns = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(rank_logp, logp, rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_grad, grad[:, columns], rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_loss, loss, rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_kl, top_k_kl, rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_loss_grad, loss_grad[:, columns], rtol=0, atol=1e-6)

"""Vocabulary-parallel log-probs and entropy equal the full-softmax reference, values and gradients."""

import pytest
import torch
import torch.distributed as dist

from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.logprobs import vocab_parallel_logprobs

VOCAB, PADDED, TOKENS = 50, 64, 37


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(TOKENS, PADDED, generator=generator)
    logits[:, VOCAB:] = 1e4  # padding columns: a leak would dominate everything
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    weights = torch.randn(TOKENS, generator=generator), torch.randn(TOKENS, generator=generator)
    return logits, targets, weights


def _reference(logits, targets, weights):
    """Full-vocabulary fp64 log_softmax and entropy, with autograd gradients."""
    z = logits[:, :VOCAB].double().requires_grad_(True)
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * weights[0] + entropy * weights[1]).sum().backward()
    grad = torch.zeros(TOKENS, PADDED, dtype=torch.float64)
    grad[:, :VOCAB] = z.grad
    return logp.detach(), entropy.detach(), grad


def _ours(logits, targets, weights, **kwargs):
    logits = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=VOCAB, with_entropy=True, **kwargs)
    (logp * weights[0] + entropy * weights[1]).sum().backward()
    return logp.detach(), entropy.detach(), logits.grad


@pytest.mark.parametrize("chunk_tokens", [1, 8, 1024])
def test_single_rank_matches_full_softmax(chunk_tokens):
    logits, targets, weights = _inputs()
    expected = _reference(logits, targets, weights)
    got = _ours(logits, targets, weights, chunk_tokens=chunk_tokens)
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value.double(), reference, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[2][:, VOCAB:]) == 0  # no gradient into padding columns


def test_logprobs_alone_need_no_entropy():
    logits, targets, _ = _inputs()
    logp, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=VOCAB)
    assert entropy is None
    torch.testing.assert_close(logp, torch.log_softmax(logits[:, :VOCAB], -1).gather(-1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"expected logits \[N, V_local\] and targets \[N\], got \[3, 4\] and \[2\]"):
        vocab_parallel_logprobs(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), vocab_size=4)


def _tensor_parallel(rank, world_size, chunk_tokens):
    logits, targets, weights = _inputs()
    local = PADDED // world_size
    shard = logits[:, rank * local : (rank + 1) * local]
    logp, entropy, grad = _ours(shard, targets, weights, vocab_start=rank * local, group=dist.group.WORLD, chunk_tokens=chunk_tokens)
    return logp, entropy, grad


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_ranks_match_full_softmax(world_size):
    logits, targets, weights = _inputs()
    expected_logp, expected_entropy, expected_grad = _reference(logits, targets, weights)
    results = run_on_ranks(_tensor_parallel, world_size, timeout_s=60, args=(5,))
    local = PADDED // world_size
    for rank, (logp, entropy, grad) in enumerate(results):
        torch.testing.assert_close(logp.double(), expected_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.double(), expected_grad[:, rank * local : (rank + 1) * local], rtol=1e-5, atol=1e-5)

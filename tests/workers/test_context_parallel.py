"""Context parallelism: the zigzag split of micro-batches and the CP attention on CPU ranks.

End-to-end equality with HF and with single-rank updates is in test_worker_logprobs.py and
test_worker_update.py (cases cp2, tp2-cp2, cp2-ep2-moe); these check the pieces directly.
"""

import types

import pytest
import torch

from rlmega.models.core_attention import TorchCoreAttention
from rlmega.parallel.layout import zigzag_positions
from rlmega.parallel.spawn import run_on_ranks
from rlmega.models.attention_mask import block_causal_mask
from rlmega.workers.batching import SequenceBatch, build_micro_batch
from rlmega.workers.context_parallel import segment_positions, split_micro_batch
from rlmega.workers.passes import _on

ATOL = 1e-5  # fp32 attention, same math in a different order


def _batch(lengths=((2, 5), (3, 9), (1, 4), (4, 6))):
    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 10_000, (total,), generator=generator) for _, total in lengths]
    return SequenceBatch(tokens, [prompt for prompt, _ in lengths])


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([zigzag_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    assert segment_positions([4, 8], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="6 tokens is not a multiple of 2\\*cp = 4"):
        zigzag_positions(6, 2, 0)


def _simulate_gather(shares, name):
    """What gather_response_values returns: every rank's share concatenated, in micro-batch order."""
    return torch.cat([getattr(share, name) for share in shares])[shares[0].context_share.restore]


@pytest.mark.parametrize("packing, use_thd", [(False, False), (True, False), (True, True)], ids=["padded", "packed-mask", "packed-thd"])
@pytest.mark.parametrize("cp", [2, 3])
def test_split_shares_every_response_token_once_and_gathers_back_in_order(packing, use_thd, cp):
    batch = _batch()
    whole = build_micro_batch(batch, [0, 1, 2, 3], packing=packing, pad_to_multiple=2 * cp, use_thd=use_thd,
                              segment_multiple=2 * cp if use_thd else 1)
    shares = [split_micro_batch(whole, cp, rank) for rank in range(cp)]
    for rank, share in enumerate(shares):
        assert share.tokens.shape == (whole.tokens.shape[0], whole.tokens.shape[1] // cp)
        assert share.response_lengths == whole.response_lengths
        assert share.context_share.rank == rank and sum(share.context_share.counts) == whole.response_targets.numel()
        # A rank scores the positions it holds, and they predict the targets it was given.
        inputs = share.tokens.reshape(-1)[share.response_positions]
        assert share.response_targets.numel() == share.context_share.counts[rank]
        assert inputs.numel() == share.response_targets.numel()
    # Gathered over the ranks: the whole micro-batch's inputs and targets, in its order.
    for share in shares:
        share.inputs = share.tokens.reshape(-1)[share.response_positions]
    assert torch.equal(_simulate_gather(shares, "inputs"), whole.tokens.reshape(-1)[whole.response_positions])
    assert torch.equal(_simulate_gather(shares, "response_targets"), whole.response_targets)
    assert shares[0].attention_mask is whole.attention_mask  # the attention picks its rows itself


def test_thd_slots_are_padded_per_sequence_for_context_parallelism():
    batch = _batch()
    micro = build_micro_batch(batch, [0, 1, 2], packing=True, use_thd=True, segment_multiple=4, pad_to_multiple=4)
    params = micro.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 5, 14, 18]  # real lengths 5, 9, 4
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 20, 24]  # slots of 8, 12, 4
    assert params.max_seqlen_q == 12 and micro.tokens.shape == (1, 24)
    assert torch.equal(micro.tokens[0, 8:17], batch.tokens[1])
    flat = micro.tokens.view(-1)
    assert torch.equal(flat[micro.response_positions + 1], micro.response_targets)
    plain = build_micro_batch(batch, [0, 1, 2], packing=True, use_thd=True)
    assert plain.packed_seq_params.cu_seqlens_q_padded is None  # no slots without context parallelism
    moved = _on(params, torch.device("meta"))  # the schedule hands TE its cu_seqlens on the device
    assert moved.cu_seqlens_q_padded.device.type == "meta" and moved.max_seqlen_q == 12


def test_mask_path_keeps_slot_padding_apart():
    batch = _batch()
    micro = build_micro_batch(batch, [0, 2], packing=True, segment_multiple=4)  # 5 -> slot 8, 4 -> slot 4
    assert torch.equal(micro.attention_mask, block_causal_mask([5, 3, 4]))


# ---- the attention, on two gloo ranks ------------------------------------------------------

SEQ, HEADS, GROUPS, DIM = 8, 4, 2, 16


def _attention(cp_group, causal=True):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0)
    return TorchCoreAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask,
        attention_type="self", pg_collection=types.SimpleNamespace(cp=cp_group),
    )


def _inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, 2, HEADS, DIM, generator=generator)
    k, v = (torch.randn(SEQ, 2, GROUPS, DIM, generator=generator) for _ in range(2))
    weight = torch.randn(SEQ, 2, HEADS * DIM, generator=generator)
    mask = block_causal_mask([3, 5])  # two packed sequences
    return q, k, v, weight, mask


def _attend(attention, q, k, v, weight, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, mask)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention_body(rank, world_size):
    import torch.distributed as dist

    q, k, v, weight, mask = _inputs()
    held = zigzag_positions(SEQ, world_size, rank)
    return held, _attend(_attention(dist.group.WORLD), q[held], k[held], v[held], weight[held], mask)


def test_cp_attention_equals_whole_sequence_attention_forward_and_backward():
    q, k, v, weight, mask = _inputs()
    expected = _attend(_attention(None), q, k, v, weight, mask)
    # The mask really matters here: without it the answer differs.
    assert (_attend(_attention(None), q, k, v, weight, None)[0] - expected[0]).abs().max() > 1e-2
    for held, got in run_on_ranks(_cp_attention_body, 2, timeout_s=120):
        for name, got_tensor, want_tensor in zip(("out", "dq", "dk", "dv"), got, expected):
            # Key/value gradients sum the contributions of both ranks' queries.
            torch.testing.assert_close(got_tensor, want_tensor[held], atol=ATOL, rtol=0, msg=name)


def _dropout_body(rank, world_size):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from rlmega.parallel.layout import ParallelLayout, destroy, initialize

    initialize(ParallelLayout())
    q, k, v, weight, mask = _inputs()
    attention = _attention(None)
    fused = attention(q, k, v, mask)
    # The explicit path (used for dropout) is the same attention as the fused kernel...
    explicit = attention._attend_with_dropout(*(t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
                                              block_causal_mask([3, 5]) | torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1),
                                              DIM ** -0.5)
    explicit = explicit.permute(2, 0, 1, 3).reshape(SEQ, 2, HEADS * DIM)
    # ...and dropout in training draws from Megatron's RNG stream: reseeding repeats it.
    attention.dropout.p = 0.5
    attention.train()
    model_parallel_cuda_manual_seed(7)
    first = attention(q, k, v, mask)
    model_parallel_cuda_manual_seed(7)
    second = attention(q, k, v, mask)
    destroy()
    return fused, explicit, first, second


def test_attention_dropout_uses_megatron_rng_and_the_explicit_path_equals_the_fused_one():
    fused, explicit, first, second = run_on_ranks(_dropout_body, 1, timeout_s=120)[0]
    torch.testing.assert_close(explicit, fused, atol=ATOL, rtol=0)
    assert torch.equal(first, second)
    assert (first - fused).abs().max() > 1e-2  # dropout really applied


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cp", [2, 3])
def test_local_response_indices_pick_each_ranks_tokens_from_whole_micro_batch_inputs(packing, cp):
    from rlmega.workers.context_parallel import local_response_indices

    batch = _batch()
    whole = build_micro_batch(batch, [0, 1, 2, 3], packing=packing, pad_to_multiple=2 * cp)
    assert local_response_indices(whole) is None
    for rank in range(cp):
        share = split_micro_batch(whole, cp, rank)
        local = local_response_indices(share)
        # Per-token rows of the whole micro-batch (here its targets), indexed by them, are the rank's own.
        assert torch.equal(whole.response_targets[local], share.response_targets)
        assert local.numel() == share.context_share.counts[rank]

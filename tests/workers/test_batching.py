"""Micro-batch planning and building: balanced, within budget, lossless, and masks that isolate sequences."""

import pytest
import torch

from rlmega.models.attention_mask import block_causal_mask
from rlmega.workers.batching import (
    SequenceBatch, balance_across_ranks, build_micro_batch, count_micro_batches,
    concatenated_ranges, padded_field, split_by_token_budget, split_padded,
)


def _batch(lengths=((2, 5), (3, 9), (1, 4), (4, 6))):
    tokens = [torch.arange(100 * i, 100 * i + total) for i, (_, total) in enumerate(lengths)]
    return SequenceBatch(tokens, [prompt for prompt, _ in lengths])


def test_balance_is_by_tokens_and_covers_every_sequence():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shards = balance_across_ranks(lengths, 2)
    assert sorted(i for shard in shards for i in shard) == list(range(len(lengths)))
    assert [sum(lengths[i] for i in shard) for shard in shards] == [100, 100]  # not 6 vs 5 sequences
    assert balance_across_ranks([5], 3) == [[0], [], []]


def test_token_budget_counts_and_splits():
    lengths = [7, 5, 4, 3, 1]
    assert count_micro_batches(lengths, 10) == 2  # 7+3, 5+4+1
    assert count_micro_batches([12, 1], 10) == 2  # an over-long sequence sits alone
    groups = split_by_token_budget([0, 1, 2, 3, 4], lengths, 3)
    assert sorted(i for group in groups for i in group) == [0, 1, 2, 3, 4]
    assert max(sum(lengths[i] for i in g) for g in groups) - min(sum(lengths[i] for i in g) for g in groups) <= 3
    assert split_by_token_budget([0], [4], 2) == [[0], []]  # empty micro-batches when short of sequences


def test_packed_micro_batch_places_response_tokens_exactly():
    batch = _batch()
    micro = build_micro_batch(batch, [0, 1], packing=True, pad_to_multiple=4)
    assert micro.tokens.shape == (1, 16)  # 5 + 9 tokens, padded to a multiple of 4
    flat = micro.tokens.view(-1)
    # Each response token is predicted from the position just before it.
    assert torch.equal(flat[micro.response_positions + 1], micro.response_targets)
    assert torch.equal(micro.response_targets, torch.cat([batch.tokens[0][2:], batch.tokens[1][3:]]))
    assert micro.response_lengths == [3, 6]
    assert micro.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4] and micro.position_ids[0, 5] == 0


def test_block_causal_mask_isolates_sequences():
    mask = block_causal_mask([2, 3])[0, 0]  # True = masked
    allowed = ~mask
    assert allowed[1, 0] and allowed[1, 1] and not allowed[0, 1]  # causal inside a segment
    assert not allowed[2, 1] and allowed[4, 2]  # never across segments


def test_padded_micro_batch_and_forced_shape():
    batch = _batch()
    micro = build_micro_batch(batch, [2, 3], packing=False, shape=(3, 8))
    assert micro.tokens.shape == (3, 8) and micro.attention_mask is None
    flat = micro.tokens.view(-1)
    assert torch.equal(flat[micro.response_positions + 1], micro.response_targets)
    empty = build_micro_batch(batch, [], packing=True, pad_to_multiple=2)
    assert empty.response_targets.numel() == 0 and empty.tokens.shape == (1, 2)


def test_padded_field_round_trip():
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    padded, mask = padded_field(values)
    assert padded.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[True, True], [True, False]]
    assert torch.equal(split_padded(torch.tensor([1.0, 2.0, 3.0]), [2, 1]), padded)


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_lengths=[5]), "at least one response token"),
    (dict(fields={"advantages": [torch.zeros(2)]}), "expected \\[3, \\.\\.\\.\\]"),
    (dict(fields={"teacher_topk_ids": [torch.zeros(2, 4)]}), "has shape \\[2, 4\\], expected \\[3, \\.\\.\\.\\]"),
    (dict(prompt_lengths=[2, 2]), "1 sequences but 2 prompt lengths"),
])
def test_sequence_batch_rejects_bad_input(bad, message):
    arguments = dict(tokens=[torch.arange(5)], prompt_lengths=[2], fields={})
    arguments.update(bad)
    with pytest.raises(ValueError, match=message):
        SequenceBatch(**arguments)


def test_a_field_may_hold_a_row_per_response_token():
    batch = SequenceBatch([torch.arange(5)], [2], {"teacher_topk_ids": [torch.zeros(3, 4, dtype=torch.long)]})
    assert batch.select([0]).fields["teacher_topk_ids"][0].shape == (3, 4)


def test_concatenated_ranges_equal_one_arange_per_range():
    starts, counts = [5, 0, 17, 3, 9], [3, 0, 1, 4, 2]
    expected = torch.cat([torch.arange(start, start + count) for start, count in zip(starts, counts)])
    assert torch.equal(concatenated_ranges(starts, counts), expected)
    assert concatenated_ranges([], []).numel() == 0


def _reference_micro_batch(batch, indices, packing, width, segment_multiple=1):
    """build_micro_batch's tokens, positions and response slots, one sequence at a time (what it vectorizes)."""
    rows = 1 if packing else max(len(indices), 1)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    position_ids = torch.arange(width).repeat(rows, 1)
    positions, targets, offset = [], [], 0
    for row, index in enumerate(indices):
        sequence, prompt = batch.tokens[index], batch.prompt_lengths[index]
        start = offset if packing else row * width
        tokens.view(-1)[start:start + sequence.numel()] = sequence
        if packing:
            slot = -(-sequence.numel() // segment_multiple) * segment_multiple
            position_ids[0, offset:offset + slot] = torch.arange(slot)
            offset += slot
        positions.append(torch.arange(prompt - 1, sequence.numel() - 1) + start)
        targets.append(sequence[prompt:])
    return tokens, position_ids, torch.cat(positions), torch.cat(targets)


@pytest.mark.parametrize("packing, segment_multiple", [(True, 1), (True, 4), (False, 1)])
def test_micro_batch_equals_the_one_sequence_at_a_time_layout(packing, segment_multiple):
    generator = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(2, 12, (9,), generator=generator)]
    prompts = [int(torch.randint(1, n, (1,), generator=generator)) for n in lengths]
    batch = SequenceBatch([torch.randint(1, 50, (n,), generator=generator) for n in lengths], prompts)
    indices = [4, 0, 7, 2, 8]
    micro = build_micro_batch(batch, indices, packing=packing, pad_to_multiple=4, segment_multiple=segment_multiple)
    tokens, position_ids, positions, targets = _reference_micro_batch(
        batch, indices, packing, micro.tokens.shape[1], segment_multiple)
    assert torch.equal(micro.tokens, tokens) and torch.equal(micro.position_ids, position_ids)
    assert torch.equal(micro.response_positions, positions) and torch.equal(micro.response_targets, targets)
    assert micro.response_lengths == [lengths[i] - prompts[i] for i in indices]


def test_split_padded_passes_gradients_to_each_token():
    flat = torch.arange(1.0, 7.0, requires_grad=True)
    padded = split_padded(flat, [3, 1, 2])
    assert padded.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]]
    (padded * torch.arange(9.0).view(3, 3)).sum().backward()
    assert flat.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 6.0, 7.0]  # each token's weight where it was placed


def test_padded_field_of_mixed_lengths_and_an_empty_batch():
    values = [torch.tensor([True, False, True]), torch.tensor([False])]
    padded, mask = padded_field(values, lengths=[3, 1])
    assert padded.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]] and mask.tolist() == [[True] * 3, [True, False, False]]
    padded, mask = padded_field([])
    assert padded.shape == (0, 0) and mask.shape == (0, 0)

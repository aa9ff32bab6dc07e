"""A packed row's attention, one sequence at a time: recognised only from an exact block-causal mask, and equal
to attending over the whole row with the mask (forward and backward, fp32: 1e-6 absolute and relative, the
rounding of sums taken in another order)."""

import pytest
import torch

from rlmega.models import core_attention
from rlmega.models.core_attention import TorchCoreAttention, packed_segments
from rlmega.models.attention_mask import block_causal_mask

HEADS, GROUPS, DIM = 4, 2, 8
ATOL = RTOL = 1e-6  # dv reaches ~5: a few float32 ulps there are ~1e-6 (seen: 1.2e-6 at -3.77 on an AVX-512 CPU)


def _attention():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0)
    return TorchCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").eval()


def test_segments_are_read_only_from_an_exact_block_causal_mask():
    assert packed_segments(block_causal_mask([3, 5, 1, 4, 2])) == [3, 5, 1, 4, 2]
    assert packed_segments(None) is None
    assert packed_segments(block_causal_mask([9])) is None  # one segment: nothing to gain
    assert packed_segments(block_causal_mask([2, 30])) is None  # 2 * 30^2 >= 32^2: the whole row is cheaper
    altered = block_causal_mask([3, 5, 4]).clone()
    altered[0, 0, 6, 3] = True  # one more blocked pair inside a segment: not a packed row's mask
    assert packed_segments(altered) is None
    altered = block_causal_mask([3, 5, 4]).clone()
    altered[0, 0, 5, 1] = False  # a pair across segments allowed
    assert packed_segments(altered) is None
    assert packed_segments(block_causal_mask([3, 5]).expand(2, 1, 8, 8)) is None  # not one row


@pytest.mark.parametrize("lengths", [[3, 5, 1, 4, 2], [6, 6, 6, 6], [1, 1, 3, 1, 2]])
def test_attention_by_segment_equals_the_masked_whole_row(lengths, monkeypatch):
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(total, 1, HEADS, DIM, generator=generator)
    k, v = (torch.randn(total, 1, GROUPS, DIM, generator=generator) for _ in range(2))
    weight = torch.randn(total, 1, HEADS * DIM, generator=generator)
    mask = block_causal_mask(lengths)
    assert packed_segments(mask) == lengths  # so the first pass below goes segment by segment

    def attend():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _attention()(*inputs, mask)
        (out * weight).sum().backward()
        return [out.detach()] + [t.grad for t in inputs]

    by_segment = attend()
    calls = []
    monkeypatch.setattr(core_attention, "_attend_by_segment", lambda *args: calls.append(args) or 1 / 0)
    monkeypatch.setattr(core_attention, "packed_segments", lambda mask: None)
    whole_row = attend()  # torch's kernel over the whole row with the mask
    assert not calls
    for name, got, want in zip(("out", "dq", "dk", "dv"), by_segment, whole_row):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=name)
    # The mask matters: plain causal attention over the row differs.
    causal = _attention()(q, k, v, None)
    assert (causal - whole_row[0]).abs().max() > 1e-2


def test_a_packed_row_takes_the_segment_path(monkeypatch):
    lengths = [4, 4, 4]
    taken = []
    original = core_attention._attend_by_segment
    monkeypatch.setattr(core_attention, "_attend_by_segment",
                        lambda q, k, v, segments, scale: taken.append(segments) or original(q, k, v, segments, scale))
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(12, 1, HEADS, DIM, generator=generator)
    k, v = (torch.randn(12, 1, GROUPS, DIM, generator=generator) for _ in range(2))
    attention, mask = _attention(), block_causal_mask(lengths)
    attention(q, k, v, mask)
    attention(q, k, v, mask)  # a second layer with the same mask reads it from the last answer
    assert taken == [lengths, lengths]
    attention(q.expand(12, 2, HEADS, DIM), k.expand(12, 2, GROUPS, DIM), v.expand(12, 2, GROUPS, DIM), None)
    assert len(taken) == 2  # padded rows (batch of 2, no mask) keep torch's kernel


def test_segments_come_from_the_mask_builder_without_reading_the_mask(monkeypatch):
    mask = block_causal_mask([3, 5, 1, 4])
    monkeypatch.setattr(core_attention, "block_causal_mask", None)  # reading the mask back would call it
    assert packed_segments(mask) == [3, 5, 1, 4]
    assert packed_segments(block_causal_mask([2, 30])) is None  # still only where segments cost less


def test_the_mask_keeps_its_segments_on_the_models_device():
    """The forward step moves the mask where the model runs; the copy must still name its segments (on a
    GPU, reading them back from a CUDA mask mixed devices)."""
    from rlmega.workers.passes import _mask_on

    mask = block_causal_mask([3, 5, 1, 4])
    moved = _mask_on(mask, torch.device("meta"))  # another device: a new tensor, which cannot be read back
    assert moved.device.type == "meta" and moved.shape == mask.shape
    assert packed_segments(moved) == [3, 5, 1, 4]
    assert _mask_on(mask, None) is mask and _mask_on(None, torch.device("meta")) is None

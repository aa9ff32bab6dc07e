"""Per-sequence tensors cross processes as one tensor per list, and come back exactly as they were sent."""

import pickle

import pytest
import torch

from rlmega.data.schema import ImageInputs
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.packed import TensorList, pack, portable, unpack, unpack_array


def _storages(tensors) -> int:
    return len({tensor.untyped_storage().data_ptr() for tensor in tensors})


def _batch(num=16, routing=False, images=False) -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 50, (6 + index % 5,), generator=generator) for index in range(num)]
    prompts = [3 + index % 2 for index in range(num)]
    responses = [t.numel() - p for t, p in zip(tokens, prompts)]
    fields = {"advantages": [torch.randn(r, generator=generator) for r in responses],
              "response_mask": [torch.rand(r, generator=generator) > 0.3 for r in responses]}
    return SequenceBatch(
        tokens, prompts, fields, temperature=0.7,
        routing=[torch.randint(0, 8, (t.numel(), 2, 3), generator=generator) for t in tokens] if routing else None,
        images=[ImageInputs(pixel_values=torch.randn(4, 6), grid_thw=torch.tensor([[1, 2, 2]])) if index % 3 == 0
                else None for index in range(num)] if images else None)


@pytest.mark.parametrize("routing,images", [(False, False), (True, True)])
def test_a_batch_round_trips_exactly_with_one_storage_per_list(routing, images):
    batch = _batch(routing=routing, images=images)
    back = pickle.loads(pickle.dumps(batch))
    assert back.prompt_lengths == batch.prompt_lengths and back.temperature == batch.temperature
    pairs = [(back.tokens, batch.tokens)] + [(back.fields[name], batch.fields[name]) for name in batch.fields]
    if routing:
        pairs.append((back.routing, batch.routing))
    for got, sent in pairs:
        assert len(got) == len(sent) and _storages(got) == 1  # sent as one tensor
        for have, want in zip(got, sent):
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)
    assert back.routing is None if not routing else True
    if images:
        for have, want in zip(back.images, batch.images):
            assert (have is None) == (want is None)
            if want is not None:
                assert torch.equal(have.pixel_values, want.pixel_values) and torch.equal(have.grid_thw, want.grid_thw)
    else:
        assert back.images is None
    assert len(pickle.dumps(batch)) < len(pickle.dumps((batch.tokens, batch.fields)))  # one record per list


def test_a_selected_batch_is_repacked_alone():
    batch = pickle.loads(pickle.dumps(_batch(num=32)))
    part = pickle.loads(pickle.dumps(batch.select([1, 5])))
    assert part.tokens[0].untyped_storage().nbytes() == sum(t.numel() for t in part.tokens) * 8  # not the whole buffer
    assert torch.equal(part.tokens[1], batch.tokens[5])


def test_portable_packs_lists_of_tensors_and_leaves_the_rest():
    logp = [torch.randn(n) for n in (3, 0, 5)]
    entropy = [torch.randn(n) for n in (3, 0, 5)]
    metrics = {"loss": 1.5}
    got = pickle.loads(pickle.dumps(portable((metrics, logp, entropy))))
    assert got[0] == metrics
    for have, want in ((got[1], logp), (got[2], entropy)):
        assert isinstance(have, TensorList) and _storages(have) == 1
        assert [t.shape for t in have] == [t.shape for t in want] and all(map(torch.equal, have, want))
    assert portable(None) is None and portable({"a": 1}) == {"a": 1} and portable([]) == []


def test_lists_that_cannot_be_packed_stay_lists():
    mixed = TensorList([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    back = pickle.loads(pickle.dumps(mixed))
    assert isinstance(back, TensorList) and [t.dtype for t in back] == [torch.float32, torch.int64]
    assert pack([torch.zeros(2, 3), torch.zeros(2, 4)]) is None and pack([torch.tensor(1.0)]) is None
    assert pack([]) is None


def test_unpack_refuses_lengths_that_do_not_fit():
    flat, lengths, trailing = pack([torch.zeros(2), torch.zeros(3)])
    assert [t.numel() for t in unpack(flat, lengths, trailing)] == [2, 3]
    with pytest.raises(ValueError, match="cannot be split into rows"):
        unpack(flat, [2, 2], trailing)


def _sums(rank, world_size, batches, lists):
    return ([[int(t.sum()) for t in batch.tokens] for batch in batches], [float(t.sum()) for t in lists])


def test_batches_reach_spawned_processes_whole():
    """multiprocessing hands tensors to a spawned process as file descriptors that must outlive the pickling:
    packed copies made for it would be freed first (the child then maps a closed or reused descriptor)."""
    from rlmega.parallel.spawn import run_on_ranks

    batch = _batch()
    shared = batch.with_fields(extra=batch.fields["advantages"])  # the same tensors in two batches
    lists = TensorList(batch.fields["advantages"])
    got_tokens, got_lists = run_on_ranks(_sums, 1, timeout_s=300, args=([batch, shared], lists))[0]
    assert got_tokens == [[int(t.sum()) for t in batch.tokens]] * 2
    assert got_lists == pytest.approx([float(t.sum()) for t in lists], abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool,
                                   torch.float8_e4m3fn])
def test_every_dtype_crosses_as_a_numpy_array_bit_for_bit(dtype):
    """CPU lists cross as numpy arrays (cheaper to pickle than tensors); dtypes numpy lacks go as their bits."""
    values = [torch.randn(n, 2).to(dtype) for n in (3, 1, 4)]
    reduced = TensorList(values).__reduce__()
    assert type(reduced[1][0]).__module__ == "numpy"
    back = pickle.loads(pickle.dumps(TensorList(values)))
    for have, want in zip(back, values):
        assert have.dtype == dtype and have.shape == want.shape
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))


def test_a_read_only_array_is_copied_so_the_list_can_be_written():
    flat, lengths, trailing = pack([torch.arange(3.0), torch.arange(2.0)])
    array = flat.numpy().copy()
    array.flags.writeable = False  # as Ray hands over an object store buffer
    back = unpack_array(array, "float32", lengths, trailing)
    back[0][0] = 7.0
    assert back[0].tolist() == [7.0, 1.0, 2.0] and array[0] == 0.0

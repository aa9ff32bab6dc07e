"""select_next_tokens: greedy, temperature, top-k, top-p and per-row generators, on hand-made logits."""

import torch

from rlmega.rollout.sampling import RowSampling, request_generator, select_next_tokens

CPU = torch.device("cpu")
# Row probabilities 0.5, 0.25, 0.125, ... over 6 tokens, in a scrambled token order.
ORDER = torch.tensor([3, 0, 5, 1, 4, 2])
LOGITS = torch.empty(6).index_put_((ORDER,), torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125])))


def _rows(num_rows, temperature=1.0, top_k=None, top_p=1.0, seed=0):
    top_k = torch.full((num_rows,), top_k or LOGITS.numel())
    return RowSampling(torch.full((num_rows,), float(temperature)), top_k, torch.full((num_rows,), float(top_p)),
                       [request_generator(seed, 0, row, CPU) for row in range(num_rows)])


def _draw(num_rows=400, **kwargs):
    tokens, logprobs = select_next_tokens(LOGITS.expand(num_rows, -1).clone(), _rows(num_rows, **kwargs))
    return tokens, logprobs


def test_greedy_rows_take_the_argmax():
    tokens, logprobs = _draw(num_rows=3, temperature=0)
    assert tokens.tolist() == [3, 3, 3]
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5] * 3)), rtol=0, atol=1e-6)


def test_logprobs_are_under_the_tempered_logits_whatever_the_filters():
    tokens, logprobs = _draw(temperature=0.3, top_k=3, top_p=0.6)
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS / 0.3, -1)[tokens], rtol=0, atol=1e-6)
    assert not torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens])  # the raw logits would differ


def test_top_k_keeps_the_k_most_likely_tokens():
    tokens, _ = _draw(top_k=2)
    assert set(tokens.tolist()) == {3, 0}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert set(_draw(top_p=0.74)[0].tolist()) == {3, 0}  # 0.5 + 0.25 reaches 0.74
    assert set(_draw(top_p=0.76)[0].tolist()) == {3, 0, 5}
    assert set(_draw(top_p=0.49)[0].tolist()) == {3}


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # Among the top 2 (2/3, 1/3), the first alone holds 2/3 >= 0.6; without top-k it would hold 0.5 < 0.6.
    assert set(_draw(top_k=2, top_p=0.6)[0].tolist()) == {3}
    assert set(_draw(top_p=0.6)[0].tolist()) == {3, 0}


def test_sampling_follows_the_tempered_distribution():
    tokens, _ = _draw(num_rows=4000, temperature=1.0, seed=1)
    frequency = torch.bincount(tokens, minlength=6).float() / tokens.numel()
    torch.testing.assert_close(frequency, torch.softmax(LOGITS, -1), rtol=0, atol=0.03)
    cold, _ = _draw(num_rows=4000, temperature=0.25, seed=1)  # p^4: token 3 gets 0.5^4 / sum ≈ 0.94
    assert (cold == 3).float().mean() > 0.9


def test_each_row_draws_from_its_own_generator():
    first, _ = _draw(seed=5)
    again, _ = _draw(seed=5)
    assert torch.equal(first, again)
    assert not torch.equal(first, _draw(seed=6)[0])
    # A row's draw does not depend on the other rows of the batch.
    alone, _ = select_next_tokens(LOGITS[None].clone(), RowSampling(
        torch.ones(1), torch.tensor([6]), torch.ones(1), [request_generator(5, 0, 1, CPU)]))
    assert alone.item() == first[1].item()


def test_request_seeds_separate_prompts_and_samples():
    def first_draw(seed, prompt, sample):
        return torch.rand(4, generator=request_generator(seed, prompt, sample, CPU))

    assert torch.equal(first_draw(1, 2, 3), first_draw(1, 2, 3))
    draws = [first_draw(1, 0, 0), first_draw(1, 0, 1), first_draw(1, 1, 0), first_draw(2, 0, 0)]
    assert len({tuple(d.tolist()) for d in draws}) == 4


def test_a_row_draws_the_inverse_of_its_distribution_at_one_uniform_of_its_generator():
    rows = _rows(64, top_k=4, seed=3)  # top-k 4: tokens 4 and 2, the two least likely, have probability 0
    uniforms = [torch.rand((), generator=request_generator(3, 0, row, CPU)).item() for row in range(64)]
    tokens, _ = select_next_tokens(LOGITS.expand(64, -1).clone(), rows)
    kept = torch.softmax(LOGITS, -1) * torch.tensor([1.0, 1, 0, 1, 0, 1])  # by token id
    bounds = (kept.cumsum(0) / kept.sum()).tolist()
    expected = [next(token for token, bound in enumerate(bounds) if u < bound) for u in uniforms]
    assert tokens.tolist() == expected
    assert set(expected) == {3, 0, 5, 1}  # every kept token drawn at least once, no other


def test_rows_without_filters_draw_as_they_would_beside_filtered_rows():
    plain = _rows(8, seed=4)
    mixed = RowSampling(plain.temperature, torch.tensor([6, 2] * 4), torch.tensor([1.0, 0.5] * 4),
                        [request_generator(4, 0, row, CPU) for row in range(8)])
    alone, _ = select_next_tokens(LOGITS.expand(8, -1).clone(), plain)
    beside, _ = select_next_tokens(LOGITS.expand(8, -1).clone(), mixed)
    assert beside[0::2].tolist() == alone[0::2].tolist()  # the unfiltered rows take the same tokens
    assert set(beside[1::2].tolist()) <= {3}  # top-k 2 then top-p 0.5 of (2/3, 1/3) keeps token 3 alone


def test_a_row_takes_one_number_of_its_generator_per_token_across_blocks():
    # Each sampled row's k-th token comes from the k-th number of its generator, whether the numbers are drawn one
    # at a time or UNIFORM_BLOCK at a time; greedy rows draw none (the sampled rows' streams do not move for them).
    from rlmega.rollout.sampling import UNIFORM_BLOCK

    steps = 2 * UNIFORM_BLOCK + 5
    rows = _rows(6, seed=8)
    rows.temperature[[1, 4]] = 0.0
    sampled = [0, 2, 3, 5]
    drawn = torch.stack([select_next_tokens(LOGITS.expand(6, -1).clone(), rows)[0] for _ in range(steps)], dim=1)
    bounds = (torch.softmax(LOGITS, -1).double().cumsum(0)).tolist()
    for row in sampled:
        generator = request_generator(8, 0, row, CPU)
        uniforms = [torch.rand((), generator=generator).double().item() for _ in range(steps)]
        assert drawn[row].tolist() == [next(t for t, bound in enumerate(bounds) if u * bounds[-1] < bound)
                                       for u in uniforms], row
    assert set(drawn[[1, 4]].flatten().tolist()) == {int(LOGITS.argmax())}

"""The teacher worker's log-probs and top-k tokens equal the transformers model's (fp32), at TP1 and TP2 with a
padded vocabulary: one that both TP slices hold tokens of, and one whose second slice is all padding."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, WorkerConfig
from rlmega.workers.top_k import vocab_parallel_top_k
from rlmega.workers.worker import MegatronWorker

ATOL = 1e-4  # fp32 on CPU: the acceptance bound against HF
TIMEOUT_S = 240
K = 6
SLICE = 512  # Megatron pads both vocabularies to 1024 columns: two slices of 512 at TP2
LENGTHS = [(3, 9), (2, 5), (4, 12), (2, 7), (5, 10)]  # (prompt, total)


def _batch(vocab: int, temperature: float = 1.0) -> SequenceBatch:
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, vocab, (total,), generator=generator) for _, total in LENGTHS]
    return SequenceBatch(tokens, [prompt for prompt, _ in LENGTHS], temperature=temperature)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Tiny random Llama teachers: vocabulary 1000 (tokens in both TP slices, the last 24 columns padding) and
    100 (the second slice all padding)."""
    paths = {}
    for vocab in (1000, 100):
        torch.manual_seed(vocab)
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():  # logits spread wide enough that the top-k ranks are clear
            model.lm_head.weight.mul_(20.0)
        paths[vocab] = tmp_path_factory.mktemp(f"teacher{vocab}")
        model.save_pretrained(paths[vocab])
    return paths


def _hf_reference(hf_dir, batch: SequenceBatch):
    """Per sequence: the sampled tokens' log-probs [R], the top-k ids [R, K] and log-probs [R, K]."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    logprobs, ids, top = [], [], []
    with torch.no_grad():
        for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
            logits = model(tokens.unsqueeze(0)).logits[0, prompt - 1:-1] / batch.logit_scale
            log_softmax = torch.log_softmax(logits, dim=-1)
            logprobs.append(log_softmax.gather(-1, tokens[prompt:].unsqueeze(-1))[:, 0])
            values, indices = log_softmax.topk(K, dim=-1)
            ids.append(indices)
            top.append(values)
    return logprobs, ids, top


def _teacher_body(rank, world_size, layout, hf_dir, batch):
    initialize(layout)
    config = WorkerConfig(role="teacher", batching=BatchingConfig(max_tokens_per_microbatch=20))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    result = worker.compute_logprobs(batch), worker.compute_top_k(batch, K)
    destroy()
    return result


CASES = {  # vocabulary, layout, temperature
    "tp1": (1000, dict(world_size=1), 1.0),
    "tp2": (1000, dict(tp=2, world_size=2), 1.0),
    "tp2-padding-slice": (100, dict(tp=2, world_size=2), 1.0),
    "dp2-temperature": (1000, dict(world_size=2), 0.7),
    "cp2": (1000, dict(cp=2, world_size=2), 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_logprobs_and_top_k_match_hf(teachers, case):
    vocab, layout_args, temperature = CASES[case]
    layout = ParallelLayout(**layout_args)
    batch = _batch(vocab, temperature)
    expected_logp, expected_ids, expected_top = _hf_reference(teachers[vocab], batch)
    if vocab > SLICE:  # the top-k come from both TP slices, so the merge matters
        every_id = torch.cat(expected_ids)
        assert (every_id < SLICE).any() and (every_id >= SLICE).any()
    for (logp, _), (ids, top) in run_on_ranks(_teacher_body, layout.world_size, timeout_s=TIMEOUT_S,
                                              args=(layout, str(teachers[vocab]), batch)):
        for got, want in zip(logp, expected_logp):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for got_ids, got_top, want_ids, want_top in zip(ids, top, expected_ids, expected_top):
            assert got_ids.dtype == torch.int64 and got_top.dtype == torch.float32
            assert torch.equal(got_ids, want_ids)
            torch.testing.assert_close(got_top, want_top, atol=ATOL, rtol=0)


def _slices_body(rank, world_size, logits, k, vocab_size):
    import torch.distributed as dist

    width = logits.shape[1] // world_size
    return vocab_parallel_top_k(logits[:, rank * width:(rank + 1) * width], k, vocab_size=vocab_size,
                                vocab_start=rank * width, group=dist.group.WORLD, chunk_tokens=3)


def test_top_k_over_slices_smaller_than_k_skips_padding():
    """Three ranks of 4 columns, the last 3 padding (huge logits there that must not count); k = 6 takes more
    tokens than any one slice holds; chunks of 3 rows."""
    logits = torch.randn(7, 12, generator=torch.Generator().manual_seed(2)) * 3
    logits[:, 9:] = 1e4
    expected_top, expected_ids = torch.log_softmax(logits[:, :9], dim=-1).topk(6, dim=-1)
    for ids, top in run_on_ranks(_slices_body, 3, timeout_s=60, args=(logits, 6, 9)):
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(top, expected_top, atol=1e-6, rtol=0)


def test_top_k_refuses_k_larger_than_the_vocabulary():
    with pytest.raises(ValueError, match="1 <= k <= the vocabulary size 9"):
        vocab_parallel_top_k(torch.zeros(2, 16), 10, vocab_size=9)


def test_other_roles_refuse_top_k():
    from rlmega.workers.roles import ROLES

    with pytest.raises(RuntimeError, match="compute_top_k needs a teacher worker; this one is the ref"):
        ROLES["ref"].require("compute_top_k")
    assert not ROLES["teacher"].trains and ROLES["teacher"].serves("compute_logprobs")

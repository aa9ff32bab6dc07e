"""``start_teachers`` puts each teacher on Ray ranks of its own, loaded from its checkpoint: its log-probs and top-k
tokens are the transformers model's, sequences reach the teacher of their data source, and shutdown ends the ranks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmega.config import load_config
from rlmega.trainer.cluster import start_teachers
from rlmega.workers.batching import SequenceBatch

ATOL = 1e-4


def _hf(model_dir, batch, k):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs, top = [], []
    with torch.no_grad():
        for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
            log_softmax = torch.log_softmax(model(tokens.unsqueeze(0)).logits[0, prompt - 1:-1], dim=-1)
            logprobs.append(log_softmax.gather(-1, tokens[prompt:].unsqueeze(-1))[:, 0])
            top.append(log_softmax.topk(k, dim=-1))
    return logprobs, top


@pytest.mark.timeout(300)
def test_teachers_on_ray_ranks_score_like_transformers(tiny_assets, tmp_path, local_ray):
    model = tiny_assets() / "model"
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "teacher.enable=true", f"teacher.path={model}"],
                         check=False)
    teachers, placement = start_teachers(config)
    try:
        assert [node["rank"] for node in placement["teacher_ranks"]] == [0]
        generator = torch.Generator().manual_seed(3)
        batch = SequenceBatch([torch.randint(4, 100, (n,), generator=generator) for n in (9, 6, 11)], [4, 3, 5])
        logprobs, _ = teachers.compute_logprobs(batch, ["a", "b", "a"])
        ids, top = teachers.compute_top_k(batch, 5, ["a", "b", "a"])
    finally:
        teachers.shutdown()
    expected, expected_top = _hf(model, batch, 5)
    for got, want in zip(logprobs, expected):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for got_ids, got_top, (want_top, want_ids) in zip(ids, top, expected_top):
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_top, want_top, atol=ATOL, rtol=0)


def test_nothing_starts_without_a_teacher(tmp_path):
    assert start_teachers(load_config("tiny_cpu", [f"run_dir={tmp_path}"], check=False)) == (None, {})

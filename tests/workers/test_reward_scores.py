"""The reward worker's scores equal transformers' ``*ForSequenceClassification`` logits: read at each
sequence's last non-pad token, in every layout, packed or padded micro-batches."""

import pytest
import torch

from reward_models import PAD, hf_scores, save_tiny_reward_model
from rlmega.models import model_spec_from_hf
from rlmega.models.reward_head import score_position
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, WorkerConfig
from rlmega.workers.model import check_head
from rlmega.workers.worker import MegatronWorker

ATOL = 1e-4  # fp32 on CPU: the acceptance bound against HF
TIMEOUT_S = 240


def make_batch() -> SequenceBatch:
    """Sequences of different lengths; some end in pad tokens (a pad token that is also the end of
    text), one has a pad token inside, one is nothing but pad tokens after its first token."""
    generator = torch.Generator().manual_seed(11)
    tokens = [torch.randint(0, PAD, (length,), generator=generator) for length in (9, 5, 12, 7, 10, 6, 4)]
    tokens[1][-2:] = PAD
    tokens[2][4] = PAD
    tokens[3][-1] = PAD
    tokens[6][1:] = PAD
    return SequenceBatch(tokens, [2] * len(tokens))


@pytest.fixture(scope="module")
def reward_checkpoints(tmp_path_factory):
    paths = {}
    for name, arch, pad in (("llama", "llama", PAD), ("qwen3", "qwen3", PAD), ("llama-no-pad", "llama", None)):
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny_reward_model(arch, paths[name], pad_token_id=pad)
    return paths


def test_score_position_is_transformers_choice_in_padded_batches():
    batch = make_batch()
    width = max(batch.lengths) + 3
    for left in (False, True):
        rows, offsets = torch.full((len(batch), width), PAD), []
        for row, seq in enumerate(batch.tokens):
            offsets.append(width - seq.numel() if left else 0)
            rows[row, offsets[-1]:offsets[-1] + seq.numel()] = seq
        # transformers' modeling_layers.GenericForSequenceClassification, verbatim
        non_pad_mask = (rows != PAD).to(torch.int32)
        hf_choice = (torch.arange(width, dtype=torch.int32) * non_pad_mask).argmax(-1)
        assert [offset + score_position(seq, PAD) for offset, seq in zip(offsets, batch.tokens)] == hf_choice.tolist()
    assert score_position(torch.full((3,), PAD), PAD) == 0  # all pad: HF's argmax of zeros
    assert score_position(batch.tokens[1], None) == 4  # no pad token: the last token (HF's batch of one)


def test_roles_refuse_the_wrong_head(reward_checkpoints, tmp_path):
    from hf_models import save_tiny_model

    reward = model_spec_from_hf(reward_checkpoints["llama"])
    save_tiny_model("llama", tmp_path)
    causal = model_spec_from_hf(tmp_path)
    check_head(reward, "reward")
    with pytest.raises(ValueError, match="the reward role needs a sequence-classification checkpoint"):
        check_head(causal, "reward")
    with pytest.raises(ValueError, match="the actor computes log-probs and needs a causal LM"):
        check_head(reward, "actor")


def _scores_body(rank, world_size, layout, hf_dir, sequence_parallel):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    scores = {}
    for packing in (True, False):  # a 20-token budget: several micro-batches per rank
        config = WorkerConfig(role="reward", batching=BatchingConfig(packing=packing, max_tokens_per_microbatch=20),
                              sequence_parallel=sequence_parallel)
        scores[packing] = MegatronWorker(spec, layout, config, hf_dir=hf_dir).compute_scores(make_batch())
    destroy()
    return scores


CASES = {  # checkpoint, layout, sequence parallelism (None: the default, off for a dense model on CPU)
    "llama-tp1": ("llama", dict(world_size=1), None),
    "llama-tp2-sp": ("llama", dict(tp=2, world_size=2), True),  # the score head's gather over the sequence slices
    "llama-pp2": ("llama", dict(pp=2, world_size=2), None),
    "llama-dp2": ("llama", dict(world_size=2), None),
    "llama-cp2": ("llama", dict(cp=2, world_size=2), None),
    "qwen3-tp1": ("qwen3", dict(world_size=1), None),
    "qwen3-tp2": ("qwen3", dict(tp=2, world_size=2), None),
    "qwen3-pp2": ("qwen3", dict(pp=2, world_size=2), None),
    "llama-no-pad-tp1": ("llama-no-pad", dict(world_size=1), None),  # HF then scores one sequence at a time
}


@pytest.mark.parametrize("case", list(CASES))
def test_reward_scores_match_hf(reward_checkpoints, case):
    checkpoint, layout_args, sequence_parallel = CASES[case]
    layout = ParallelLayout(**layout_args)
    batch = make_batch()
    expected = hf_scores(reward_checkpoints[checkpoint], batch.tokens)
    assert expected.abs().min() > 1e-2  # scores far from 0, so a wrong position shows
    for scores in run_on_ranks(_scores_body, layout.world_size, timeout_s=TIMEOUT_S,
                               args=(layout, str(reward_checkpoints[checkpoint]), sequence_parallel)):
        for packing, got in scores.items():  # every rank has the whole batch's scores
            assert got.shape == (len(batch),) and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"packing={packing}")

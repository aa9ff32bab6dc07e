"""HF ``*ForSequenceClassification`` reward models -> Megatron -> HF: the score head's per-token
outputs match transformers' in every layout, and the export is bit-identical to the saved checkpoint."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_models import probe_tokens
from reward_models import PAD, hf_token_scores, save_tiny_reward_model
from rlmega.bridge import export_hf_weights, load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.models.reward_head import ScoreHeadSpec
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks

SCORES_ATOL = 1e-4  # fp32; the acceptance bound for HF vs Megatron
TIMEOUT_S = 180
LAYOUTS = {"tp1": dict(world_size=1), "tp2": dict(tp=2, world_size=2), "pp2": dict(pp=2, world_size=2)}
# Qwen2's config ties its embeddings, which a score head never is (and qkv biases).
CASES = [(arch, layout) for arch in ("llama", "qwen3") for layout in LAYOUTS] + [("qwen2-tied", "tp2")]
ARCHS = sorted({arch for arch, _ in CASES})


@pytest.fixture(scope="module")
def reward_checkpoints(tmp_path_factory):
    saved = {}
    for arch in ARCHS:
        saved[arch] = tmp_path_factory.mktemp(f"{arch}-reward")
        save_tiny_reward_model(arch, saved[arch])
    return saved


def test_spec_has_the_score_head_and_never_ties_it(reward_checkpoints, tmp_path):
    spec = model_spec_from_hf(reward_checkpoints["llama"])
    assert spec.architecture == "LlamaForSequenceClassification"
    assert spec.score_head == ScoreHeadSpec(num_labels=1, pad_token_id=PAD)
    qwen2 = dict(architectures=["Qwen2ForSequenceClassification"], vocab_size=100, hidden_size=64,
                 intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=True)
    spec = model_spec_from_hf(qwen2)  # no id2label: transformers' default of 2 labels
    assert spec.score_head == ScoreHeadSpec(num_labels=2, pad_token_id=None) and not spec.tie_word_embeddings
    assert spec.config == model_spec_from_hf(dict(qwen2, architectures=["Qwen2ForCausalLM"])).config


def _token_scores(chunks, tokens):
    """``[B, S, num_labels]`` on the last pipeline stage (None elsewhere), via Megatron's schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch, torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch), None)
        return output, lambda out: (out.sum() * 0, {"scores": out.detach().clone()})

    rows = list(tokens.split(1))
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(rows), model=chunks[0], num_microbatches=len(rows),
        seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([output["scores"] for output in outputs])


def _import_score_export(rank, world_size, layout, hf_dir):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    for chunk in chunks:
        chunk.eval()
    load_hf_weights(chunks, spec, hf_dir)
    head_shapes = [list(c.output_layer.weight.shape) for c in chunks if c.post_process]
    with torch.no_grad():
        scores = _token_scores(chunks, probe_tokens())
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, spec, bucket_bytes=64 * 1024)}
    destroy()
    return scores, head_shapes, exported


@pytest.mark.parametrize("arch, layout_name", CASES, ids=[f"{arch}-{layout}" for arch, layout in CASES])
def test_reward_model_scores_match_hf_and_export_is_bit_identical(reward_checkpoints, arch, layout_name):
    directory = reward_checkpoints[arch]
    layout = ParallelLayout(**LAYOUTS[layout_name])
    results = run_on_ranks(_import_score_export, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(directory)))

    expected = hf_token_scores(directory, probe_tokens())
    last_stage = [(scores, shapes) for scores, shapes, _ in results if scores is not None]
    assert len(last_stage) == layout.tp  # every TP rank of the last stage has the whole scores
    for scores, shapes in last_stage:
        assert shapes == [[1, 64]]  # [num_labels, hidden]: no vocabulary padding, replicated over TP
        assert scores.shape == expected.shape
        assert (scores - expected).abs().max().item() <= SCORES_ATOL

    saved = load_file(Path(directory) / "model.safetensors")
    assert "score.weight" in saved and "lm_head.weight" not in saved
    for _, _, exported in results:  # every rank receives the whole stream
        assert sorted(exported) == sorted(saved), "exported keys differ from the checkpoint's"
        for name, tensor in saved.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

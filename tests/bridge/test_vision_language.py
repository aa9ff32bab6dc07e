"""Qwen2.5-VL on Megatron: a tiny random checkpoint saved by transformers, imported at TP1, TP2 and PP2 (the vision
tower on the first stage), gives transformers' logits on text-only and image prompts (images of two sizes, two in one
sequence), its multimodal position ids are transformers', and the export is bit-identical."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlmega.bridge import export_hf_weights, load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.models.vision_language import mrope_positions
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks

from vl_models import IMAGE, MERGE, VOCAB, hf_logits, image_run, save_tiny_vl, vl_cases

LOGITS_ATOL = 1e-4  # fp32
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model = save_tiny_vl(directory)
    vision = model_spec_from_hf(directory).vision
    references = []
    for ids, pixels, grid in vl_cases():
        references.append(hf_logits(model, ids, pixels, grid))
        if pixels is not None:
            positions, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid)
            assert torch.equal(mrope_positions(ids[0], grid, vision), positions[:, 0])
    return directory, references


def _forward(rank, world_size, layout, hf_dir, sequence_parallel):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout, spec.transformer_config(layout, sequence_parallel=sequence_parallel))
    for chunk in chunks:
        chunk.eval()
    load_hf_weights(chunks, spec, hf_dir)
    logits = []
    for ids, pixels, grid in vl_cases():
        def forward_step(iterator, model):
            batch = next(iterator)
            positions = mrope_positions(batch[0], grid, spec.vision).unsqueeze(1)
            output = model(batch, positions, None, pixel_values=pixels, image_grid_thw=grid)
            return output, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([ids]), model=chunks[0], num_microbatches=1,
                seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
        if ps.is_pipeline_last_stage():
            local = outputs[0]["logits"]
            shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits.append(torch.cat(shards, dim=-1)[0, :, :VOCAB])
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, spec, destinations=[world_size - 1])}
    destroy()
    return logits, exported


LAYOUTS = {"tp1": (dict(), False), "tp2": (dict(tp=2), False), "tp2-sequence-parallel": (dict(tp=2), True),
           "pp2": (dict(pp=2), False)}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_logits_equal_transformers_and_export_is_bit_identical(checkpoint, case):
    directory, references = checkpoint
    layout, sequence_parallel = LAYOUTS[case]
    parallel = ParallelLayout(world_size=layout.get("tp", 1) * layout.get("pp", 1), **layout)
    logits, exported = run_on_ranks(_forward, parallel.world_size, timeout_s=TIMEOUT_S,
                                    args=(parallel, str(directory), sequence_parallel))[-1]
    assert len(logits) == len(references)
    for got, want in zip(logits, references):
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
    saved = load_file(str(directory / "model.safetensors"))
    assert sorted(exported) == sorted(saved)
    assert any(name.startswith("visual.") for name in exported)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def test_the_spec_reads_the_vision_side(checkpoint):
    directory, _ = checkpoint
    spec = model_spec_from_hf(directory)
    assert spec.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert spec.config["mrope_section"] == [2, 3, 3] and spec.config["add_qkv_bias"]
    assert spec.vision.image_token_id == IMAGE and spec.vision.spatial_merge_size == MERGE
    assert spec.vision.tokens_per_image(torch.tensor([[1, 4, 8]])).tolist() == [8]


def test_image_tokens_and_grids_that_disagree_are_refused(checkpoint):
    directory, _ = checkpoint
    vision = model_spec_from_hf(directory).vision
    ids = torch.tensor([5] + image_run((1, 4, 4)) + [6])
    with pytest.raises(ValueError, match="more image tokens"):
        mrope_positions(ids, None, vision)
    with pytest.raises(ValueError, match="fewer image tokens"):
        mrope_positions(ids, torch.tensor([[1, 4, 4], [1, 4, 4]]), vision)

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

VOCAB, IMAGE, START, END = 160, 150, 152, 153
LOGITS_ATOL = 1e-4  # fp32
TIMEOUT_S = 240
PATCH, TEMPORAL, MERGE = 4, 2, 2


def _config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=151, vision_start_token_id=START, vision_end_token_id=END,
        architectures=["Qwen2_5_VLForConditionalGeneration"])


def _image_run(grid):
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]


def _cases():
    """(input ids [1, L], pixel values or None, grid_thw or None): text only; one image; two images of other sizes."""
    generator = torch.Generator().manual_seed(4)

    def text(n):
        return torch.randint(3, 140, (n,), generator=generator).tolist()

    def pixels(grids):
        patches = sum(t * h * w for t, h, w in grids)
        return torch.randn(patches, 3 * TEMPORAL * PATCH * PATCH, generator=generator)

    one, two = [(1, 4, 4)], [(1, 4, 8), (1, 8, 4)]
    return [
        (torch.tensor([text(12)]), None, None),
        (torch.tensor([text(3) + _image_run(one[0]) + text(5)]), pixels(one), torch.tensor(one)),
        (torch.tensor([text(2) + _image_run(two[0]) + text(3) + _image_run(two[1]) + text(5)]), pixels(two),
         torch.tensor(two)),
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(_config(), attn_implementation="eager").float().eval()
    with torch.no_grad():  # random norms and biases, so a dropped or swapped one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name or "ln_q" in name
                            else 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    references = []
    with torch.no_grad():
        for ids, pixels, grid in _cases():
            kwargs = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=grid,
                                                    mm_token_type_ids=(ids == IMAGE).int())
            references.append(model(input_ids=ids, **kwargs).logits[0])
            if pixels is not None:
                positions, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid)
                assert torch.equal(mrope_positions(ids[0], grid, model_spec_from_hf(directory).vision),
                                   positions[:, 0])
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
    for ids, pixels, grid in _cases():
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
    ids = torch.tensor([5] + _image_run((1, 4, 4)) + [6])
    with pytest.raises(ValueError, match="more image tokens"):
        mrope_positions(ids, None, vision)
    with pytest.raises(ValueError, match="fewer image tokens"):
        mrope_positions(ids, torch.tensor([[1, 4, 4], [1, 4, 4]]), vision)

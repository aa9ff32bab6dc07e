"""A tiny random Qwen2.5-VL checkpoint saved by transformers, and prompts with images of different sizes."""

import torch

VOCAB, IMAGE, START, END = 160, 150, 152, 153
PATCH, TEMPORAL, MERGE = 4, 2, 2


def vl_config():
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


def image_run(grid):
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]


def vl_cases():
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
        (torch.tensor([text(3) + image_run(one[0]) + text(5)]), pixels(one), torch.tensor(one)),
        (torch.tensor([text(2) + image_run(two[0]) + text(3) + image_run(two[1]) + text(5)]), pixels(two),
         torch.tensor(two)),
    ]


def save_tiny_vl(directory):
    """Save the model to ``directory``; return it (fp32, eval) for references."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(vl_config(), attn_implementation="eager").float().eval()
    with torch.no_grad():  # random norms and biases, so a dropped or swapped one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name or "ln_q" in name
                            else 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def hf_logits(model, ids, pixels, grid):
    """transformers' logits ``[L, V]`` of one sequence ``[1, L]`` with its images (or none)."""
    kwargs = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=grid,
                                            mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits[0]

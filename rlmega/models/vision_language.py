"""Vision-language policies (Qwen2.5-VL): Megatron's GPTModel with multimodal RoPE, and the vision tower.

The language model is Megatron-Core's ``GPTModel`` with ``position_embedding_type="mrope"``: every token has three
position ids (temporal, height, width; equal for text), ``mrope_positions`` computes them as transformers does. The
vision tower (patch embedding, window-attention blocks, the merger that maps 2x2 patches to one LM token) is
transformers' own ``Qwen2_5_VisionTransformerPretrainedModel``, built from the checkpoint's ``vision_config``; its
output replaces the embeddings of the image-pad tokens before the first decoder layer.

Why the tower is replicated, not tensor-parallel: it is small next to the language model (about 0.67 B parameters
for every Qwen2.5-VL size, 3 B to 72 B), its sequence is an image's patches rather than the LM's tokens, and it is
usually frozen (``vision.freeze``) in RL. Sharding it over TP ranks would add two all-reduces per block for a memory
saving of a fraction of one LM layer's, so every TP rank of the first pipeline stage holds the whole tower and runs
it on its micro-batch's images (data-parallel over images, like the rest of the batch). Its gradients are equal on
every TP rank (the embedding input's gradient is reduced over TP by the first layer), so only the data-parallel
all-reduce of Megatron's DDP applies to them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl",)
"""transformers ``model_type`` of the vision-language models rlmega runs."""


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """What the model needs of a checkpoint's vision side."""

    config: dict[str, Any]
    """The HF ``vision_config`` as a dict (transformers builds the tower from it)."""
    image_token_id: int
    """The image-pad token: one per merged patch, its embedding replaced by the tower's output."""
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int

    def tokens_per_image(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[num_images]`` LM tokens of each image of ``grid_thw`` ``[num_images, 3]`` (patches / merge²)."""
        return grid_thw.prod(-1) // self.spatial_merge_size ** 2


def vision_spec_from_hf(hf: dict[str, Any]) -> VisionSpec:
    vision = dict(hf["vision_config"])
    return VisionSpec(config=vision, image_token_id=int(hf["image_token_id"]),
                      vision_start_token_id=int(hf["vision_start_token_id"]),
                      vision_end_token_id=int(hf["vision_end_token_id"]),
                      spatial_merge_size=int(vision.get("spatial_merge_size", 2)))


def image_token_mask(input_ids: torch.Tensor, vision: VisionSpec, prompt_length: Optional[int] = None) -> torch.Tensor:
    """Where a sequence's image features go: its image-pad tokens, in the prompt only (a response that happens to
    sample the pad token holds text there, as in the engine, which embeds generated tokens as text)."""
    mask = input_ids == vision.image_token_id
    if prompt_length is not None:
        mask[prompt_length:] = False
    return mask


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], vision: VisionSpec,
                    prompt_length: Optional[int] = None) -> torch.Tensor:
    """``[3, L]`` position ids of one sequence ``[L]``: text tokens count up on all three axes; an image's
    tokens take ``start + (0, row, column)`` of its merged grid, and the text after it continues from
    ``start + max(rows, columns)``. ``image_grid_thw`` ``[num_images, 3]``: the sequence's images in order;
    ``prompt_length``: image tokens are looked for before it only (``image_token_mask``)."""
    is_image = image_token_mask(input_ids, vision, prompt_length).tolist()
    grid_list = image_grid_thw.tolist() if image_grid_thw is not None else []
    grids = iter(grid_list)
    parts, position, index = [], 0, 0
    while index < len(is_image):
        end = index
        while end < len(is_image) and is_image[end] == is_image[index]:
            end += 1
        if not is_image[index]:
            parts.append(torch.arange(position, position + end - index).expand(3, -1))
            position += end - index
        else:
            remaining = end - index
            while remaining:  # adjacent images: one run of pad tokens holds them all
                t, h, w = next(grids, (None, None, None))
                if t is None:
                    raise ValueError(f"the sequence has more image tokens than its {len(grid_list)} "
                                     "image grid(s) account for")
                rows, columns = h // vision.spatial_merge_size, w // vision.spatial_merge_size
                grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(columns),
                                                  indexing="ij")).reshape(3, -1)
                grid[1:] += position
                grid[0] += position
                parts.append(grid)
                position += max(rows, columns)
                remaining -= grid.shape[1]
                if remaining < 0:
                    raise ValueError("an image's grid has more tokens than the image tokens in the sequence")
        index = end
    if next(grids, None) is not None:
        raise ValueError("the sequence has fewer image tokens than its image grids need")
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def build_vision_tower(vision: VisionSpec) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(**{k: v for k, v in vision.config.items() if k not in ("model_type", "transformers_version")})
    config._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)


def vision_language_model_class():
    """``GPTModel`` with a vision tower on the first pipeline stage (built lazily: Megatron imports on use)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

    class VisionLanguageGPT(GPTModel):
        """Qwen2.5-VL: ``forward`` also takes the micro-batch's images (``pixel_values`` ``[patches, C*T*P*P]``
        and ``image_grid_thw`` ``[images, 3]``, in the order their pad tokens appear) and ``position_ids``
        ``[3, B, S]`` from ``mrope_positions``."""

        def __init__(self, config, transformer_layer_spec, *, vision: VisionSpec, **kwargs):
            super().__init__(config, transformer_layer_spec, position_embedding_type="mrope", **kwargs)
            self.vision = vision
            self.visual = build_vision_tower(vision) if self.pre_process else None

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *, pixel_values=None,
                    image_grid_thw=None, image_mask=None, **kwargs):
            if self.pre_process and decoder_input is None and pixel_values is not None:
                decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw, image_mask)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

        def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                              image_grid_thw: torch.Tensor, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            """``[S, B, H]`` (sequence-parallel: this rank's part) token embeddings with the image tokens'
            (``image_mask`` ``[B, S]``; None: every image-pad token) replaced by the tower's features, images
            in batch-major order as transformers fills them."""
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)
            parallel = self.config.sequence_parallel
            if parallel:  # the whole sequence, to place the images; the gradient is split back, not reduced
                embeddings = gather_from_sequence_parallel_region(embeddings, tensor_parallel_output_grad=False)
            features = self.visual(pixel_values.to(embeddings.dtype), grid_thw=image_grid_thw).pooler_output
            mask = image_mask if image_mask is not None else input_ids == self.vision.image_token_id
            if int(mask.sum()) != features.shape[0]:
                raise ValueError(f"{int(mask.sum())} image tokens but {features.shape[0]} image features "
                                 f"(image_grid_thw {image_grid_thw.tolist()})")
            batch_major = embeddings.transpose(0, 1)
            batch_major = batch_major.masked_scatter(mask.unsqueeze(-1), features.to(embeddings.dtype))
            embeddings = batch_major.transpose(0, 1).contiguous()
            if parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings)
            return embeddings

    return VisionLanguageGPT

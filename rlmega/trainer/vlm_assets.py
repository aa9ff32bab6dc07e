"""The vision-language quickstart's local assets: a tiny Qwen2.5-VL with the character tokenizer (and its image
markup tokens), its image processor, and a task drawn on the fly whose answer is only in the picture:
"<image>Colour?" over a dark 16x16 picture with one coloured square in a random quarter, answered by the colour's
name (red, green, blue or yellow). Built on the machine (no downloads), once per directory.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

SHAPES_DATA_SOURCE = "exact_match"  # scored by the exact-match rule: the answer is the colour's name alone
IMAGE_SIZE = 16       # pixels per side: a 4x4 grid of patches of 4, 2x2 = 4 tokens after the 2x2 merge
PATCH, MERGE, TEMPORAL = 4, 2, 2
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 80, 230), "yellow": (235, 200, 30)}


def draw_square(colour: str, rng: random.Random) -> bytes:
    """A PNG of one 8x8 square of ``colour`` in a random quarter of a dark 16x16 picture (one LM token's area)."""
    import numpy as np
    from PIL import Image

    pixels = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 16, dtype=np.uint8)
    row, column = rng.randrange(2) * 8, rng.randrange(2) * 8
    pixels[row:row + 8, column:column + 8] = COLOURS[colour]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def make_shapes_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Rows in the verl / EasyR1 schema: an ``images`` column of PNG bytes, ``<image>`` in the prompt; the answer
    is only in the picture."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        colour = rng.choice(sorted(COLOURS))
        rows.append({
            "data_source": SHAPES_DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>Colour?"}],
            "images": [{"bytes": draw_square(colour, rng), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": colour},
            "extra_info": {"index": index, "split": split},
        })
    return rows


def save_tokenizer_and_image_processor(directory: str | os.PathLike, *, min_pixels: int = IMAGE_SIZE**2,
                                       max_pixels: int = IMAGE_SIZE**2):
    """Save the character tokenizer with Qwen's image markup and a Qwen2-VL image processor (patches of
    ``PATCH``, ``MERGE`` x ``MERGE`` merged) into ``directory``; returns the tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlmega.data import build_char_tokenizer

    tokenizer = build_char_tokenizer(vision=True)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, min_pixels=min_pixels,
                             max_pixels=max_pixels).save_pretrained(directory)
    return tokenizer


def prepare_tiny_vlm_assets(directory: str | os.PathLike, *, num_train: int = 2000, num_val: int = 128,
                            seed: int = 0) -> dict[str, str]:
    """Create (if missing) ``model/`` (HF checkpoint, tokenizer, image processor), ``train.parquet`` and
    ``val.parquet`` under ``directory``; returns their paths. Writes to temporary names and renames."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rlmega.data.files import write_rows
    from rlmega.trainer.assets import save_quietly

    directory = Path(directory)
    paths = {"model": directory / "model", "train": directory / "train.parquet", "val": directory / "val.parquet"}
    directory.mkdir(parents=True, exist_ok=True)
    if not (paths["model"] / "config.json").is_file():
        staging = directory / "model.tmp"
        tokenizer = save_tokenizer_and_image_processor(staging)
        start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False),
            vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                               patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                               window_size=IMAGE_SIZE, fullatt_block_indexes=[1]),
            image_token_id=pad, video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
            tie_word_embeddings=False, architectures=["Qwen2_5_VLForConditionalGeneration"])
        torch.manual_seed(seed)
        save_quietly(Qwen2_5_VLForConditionalGeneration._from_config(config).float(), staging)
        os.replace(staging, paths["model"])
    for split, rows, split_seed in (("train", num_train, seed + 1), ("val", num_val, seed + 2)):
        if not paths[split].is_file():
            staging = directory / f"{split}.tmp.parquet"
            write_rows(make_shapes_rows(rows, seed=split_seed, split=split), staging)
            os.replace(staging, paths[split])
    return {name: str(path) for name, path in paths.items()}

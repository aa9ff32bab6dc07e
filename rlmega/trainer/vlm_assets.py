"""The vision-language quickstart's local assets: a tiny Qwen2.5-VL with the character tokenizer (and its image
markup tokens), its image processor, and a counting task drawn on the fly: "<image>How many squares?" over a small
picture with 1 to 4 coloured squares, answered by the digit. Built on the machine (no downloads), once per directory.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

SHAPES_DATA_SOURCE = "exact_match"  # scored by the exact-match rule: the answer is the digit alone
IMAGE_SIZE = 16       # pixels per side: a 4x4 grid of patches of 4, 4 tokens after the 2x2 merge
PATCH, MERGE, TEMPORAL = 4, 2, 2
MAX_SQUARES = 4
COLOURS = ((230, 40, 40), (40, 200, 60), (40, 90, 230), (240, 200, 30))


def draw_squares(count: int, rng: random.Random) -> bytes:
    """A PNG of ``count`` non-overlapping 4x4 squares on a dark background, in random cells and colours."""
    import numpy as np
    from PIL import Image

    pixels = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 16, dtype=np.uint8)
    cells = rng.sample(range((IMAGE_SIZE // 4) ** 2), count)
    for cell in cells:
        row, column = divmod(cell, IMAGE_SIZE // 4)
        pixels[row * 4:row * 4 + 4, column * 4:column * 4 + 4] = rng.choice(COLOURS)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def make_shapes_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Rows in the verl / EasyR1 schema: an ``images`` column of PNG bytes, ``<image>`` in the prompt."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        count = rng.randint(1, MAX_SQUARES)
        rows.append({
            "data_source": SHAPES_DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>How many squares?"}],
            "images": [{"bytes": draw_squares(count, rng), "path": None}],
            "ability": "counting",
            "reward_model": {"style": "rule", "ground_truth": str(count)},
            "extra_info": {"index": index, "split": split},
        })
    return rows


def prepare_tiny_vlm_assets(directory: str | os.PathLike, *, num_train: int = 2000, num_val: int = 128,
                            seed: int = 0) -> dict[str, str]:
    """Create (if missing) ``model/`` (HF checkpoint, tokenizer, image processor), ``train.parquet`` and
    ``val.parquet`` under ``directory``; returns their paths. Writes to temporary names and renames."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    from rlmega.data import build_char_tokenizer
    from rlmega.data.files import write_rows

    directory = Path(directory)
    paths = {"model": directory / "model", "train": directory / "train.parquet", "val": directory / "val.parquet"}
    directory.mkdir(parents=True, exist_ok=True)
    if not (paths["model"] / "config.json").is_file():
        staging = directory / "model.tmp"
        tokenizer = build_char_tokenizer(vision=True)
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
        model = Qwen2_5_VLForConditionalGeneration._from_config(config).float()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a bar for one tiny shard is noise
        try:
            model.save_pretrained(staging)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(staging)
        Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                 min_pixels=IMAGE_SIZE * IMAGE_SIZE, max_pixels=IMAGE_SIZE * IMAGE_SIZE
                                 ).save_pretrained(staging)
        os.replace(staging, paths["model"])
    for split, rows, split_seed in (("train", num_train, seed + 1), ("val", num_val, seed + 2)):
        if not paths[split].is_file():
            staging = directory / f"{split}.tmp.parquet"
            write_rows(make_shapes_rows(rows, seed=split_seed, split=split), staging)
            os.replace(staging, paths[split])
    return {name: str(path) for name, path in paths.items()}

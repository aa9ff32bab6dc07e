"""Vision-language prompts: the ``images`` column (bytes, ``{"bytes"|"path"}`` mappings, relative paths) is read,
each ``<image>`` becomes the model's image markup with one pad token per vision feature, and every bad input is one
error naming the file, the row and the fix."""

import io

import numpy as np
import pytest
import torch

from rlmega.data import DataConfig, PromptDataset
from rlmega.data.files import write_rows
from rlmega.data.images import ImagePrompts
from rlmega.data.schema import DataFormatError

PATCH, MERGE, TEMPORAL = 4, 2, 2


def _png(height, width, seed=0) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from rlmega.trainer.vlm_assets import save_tokenizer_and_image_processor

    directory = tmp_path_factory.mktemp("vl_processor")
    tokenizer = save_tokenizer_and_image_processor(directory, min_pixels=8 * 8, max_pixels=64 * 64)
    return ImagePrompts(str(directory), tokenizer)


def _row(text, images, answer="3"):
    return {"prompt": [{"role": "user", "content": text}], "data_source": "shapes", "images": images,
            "reward_model": {"ground_truth": answer}}


def _load(processor, path, **settings):
    return PromptDataset(DataConfig(files=[str(path)], max_prompt_length=settings.pop("max_prompt_length", 256),
                                    **settings), processor.tokenizer, processor=processor)


def test_images_become_pad_tokens_and_patches(processor, tmp_path):
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "tall.png").write_bytes(_png(40, 24, seed=1))
    path = write_rows([
        _row("<image>How many?", [{"bytes": _png(16, 16), "path": None}]),
        _row("Compare <image> and <image>.", [{"bytes": _png(16, 32, seed=2), "path": None},
                                              {"bytes": None, "path": "pictures/tall.png"}]),
        _row("No picture here.", None),
    ], tmp_path / "rows.parquet")
    write_rows([_row("<image>As paths", [str(tmp_path / "pictures" / "tall.png")])], tmp_path / "paths.jsonl")
    (by_path,) = _load(processor, tmp_path / "paths.jsonl").records
    assert by_path.images.grid_thw.tolist() == [[1, 10, 6]]
    dataset = _load(processor, path)
    tokenizer = processor.tokenizer
    start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    first, second, third = dataset.records
    # 16x16 -> a 4x4 patch grid -> 4 merged tokens; 16x32 -> 4x8 -> 8; 40x24 -> 10x6 -> 15.
    assert first.images.grid_thw.tolist() == [[1, 4, 4]]
    assert second.images.grid_thw.tolist() == [[1, 4, 8], [1, 10, 6]]
    assert first.images.pixel_values.shape == (16, 3 * TEMPORAL * PATCH * PATCH)
    assert second.images.pixel_values.shape == (32 + 60, 3 * TEMPORAL * PATCH * PATCH)
    assert first.prompt_token_ids.count(pad) == 4 and second.prompt_token_ids.count(pad) == 8 + 15
    text = tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False)
    assert text == "<bos><|user|><|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>How many?<eos><|assistant|>"
    assert second.prompt_token_ids.count(start) == second.prompt_token_ids.count(end) == 2
    assert third.images is None and pad not in third.prompt_token_ids


def test_patches_come_from_the_images_the_engines_get(processor, tmp_path):
    """The patches are those of the resized image sent to the engines, patched within limits that keep it at its size
    (the limits vLLM is given), so the same pixels whichever resize backend the processor uses. That holds where the
    dataset's min and max pixels are so close that they would resize the resized image again to another grid
    (300x420 -> 8x16 px, which min 256 px would make 16x24)."""
    from PIL import Image

    from rlmega.data.images import keeping_sizes

    def processed(image_bytes, **size):
        return processor.image_processor(images=[Image.open(io.BytesIO(image_bytes)).convert("RGB")],
                                         return_tensors="pt", **size)

    original = _png(300, 420, seed=4)
    path = write_rows([_row("<image>?", [_png(37, 23, seed=3)]), _row("<image>?", [original])],
                      tmp_path / "rows.parquet")
    for record in _load(processor, path).records:
        again = processed(record.images.images[0])
        assert again["image_grid_thw"].tolist() == record.images.grid_thw.tolist()
        assert torch.equal(again["pixel_values"].float(), record.images.pixel_values)
    tight = {"size": {"shortest_edge": 256, "longest_edge": 256}}
    (record,) = _load(processor, path, min_pixels=256, max_pixels=256).records[1:]
    assert record.images.grid_thw.tolist() == [[1, 2, 4]] == processed(original, **tight)["image_grid_thw"].tolist()
    (sent,) = record.images.images
    assert processed(sent, **tight)["image_grid_thw"].tolist() == [[1, 4, 6]]  # the dataset's limits would re-grid
    kept = processed(sent, size=keeping_sizes([Image.open(io.BytesIO(sent))]))
    assert kept["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert torch.equal(kept["pixel_values"].float(), record.images.pixel_values)


def test_pixel_limits_resize_the_images(processor, tmp_path):
    path = write_rows([_row("<image>?", [_png(64, 64)])], tmp_path / "rows.parquet")
    small = _load(processor, path, max_pixels=16 * 16).records[0]
    assert small.images.grid_thw.tolist() == [[1, 4, 4]]
    assert torch.isfinite(small.images.pixel_values).all()


@pytest.mark.parametrize("row, message", [
    (_row("<image>?", ["missing.png"]), r"rows.parquet row 0: image 0: no image file at .*missing.png"),
    (_row("<image>?", [b"not a picture"]), r"rows.parquet row 0: image 0: not a readable image"),
    (_row("Two: <image> <image>", [_png(16, 16)]), r"rows.parquet row 0: the prompt has 2 <image> placeholder\(s\) "
                                                     r"for 1 image\(s\)"),
    (_row("No placeholder", [_png(16, 16)]), r"the prompt has 0 <image> placeholder\(s\) for 1 image\(s\)"),
])
def test_bad_images_name_the_row(processor, tmp_path, row, message):
    path = write_rows([row], tmp_path / "rows.parquet")
    with pytest.raises(DataFormatError, match=message):
        _load(processor, path)


def test_a_prompt_with_images_is_never_truncated(processor, tmp_path):
    path = write_rows([_row("<image>How many?", [_png(32, 32)])], tmp_path / "rows.parquet")
    with pytest.raises(DataFormatError, match=r"row 0: the prompt with its images is \d+ tokens, longer than "
                                              r"data.max_prompt_length=10, and a prompt with images cannot be truncated"):
        _load(processor, path, max_prompt_length=10, truncation="left")

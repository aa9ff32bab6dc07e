"""Images of vision-language prompts (verl's and EasyR1's schema): read, placed in the prompt, made model inputs.

A row's ``images`` column (``data.image_key``) lists its images, each as raw bytes, a ``{"bytes": ..., "path": ...}``
mapping (how parquet files written by ``datasets`` store an image) or a path (relative to the data file's folder).
The prompt marks where each goes with ``<image>``; there must be one per image. The model's processor then
resizes each image (within ``data.min_pixels`` / ``data.max_pixels``), cuts it into patches, and expands the
image's placeholder into as many pad tokens as the vision tower makes features.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from rlmega.data.schema import DataFormatError, Message

IMAGE_PLACEHOLDER = "<image>"


def read_images(value: Any, where: str, base_dir: str) -> list:
    """The row's images as RGB ``PIL.Image`` objects (an empty list for None)."""
    from PIL import Image, UnidentifiedImageError

    if value is None:
        return []
    if isinstance(value, (str, bytes, Mapping)):
        value = [value]
    images = []
    for position, item in enumerate(value):
        label = f"{where}: image {position}"
        if isinstance(item, Mapping):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, str):
            path = item if os.path.isabs(item) else os.path.join(base_dir, item)
            if not os.path.isfile(path):
                raise DataFormatError(f"{label}: no image file at {path}; paths are relative to the data file's "
                                      "folder, or give the image's bytes")
            source = path
        elif isinstance(item, (bytes, bytearray)):
            source = io.BytesIO(item)
        else:
            raise DataFormatError(f"{label}: an image must be bytes, a path or a mapping with 'bytes' or 'path', "
                                  f"got {type(item).__name__}")
        try:
            with Image.open(source) as image:
                images.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as error:
            raise DataFormatError(f"{label}: not a readable image ({error})") from None
    return images


def place_images(messages: Sequence[Message], count: int, where: str, vision_text: str) -> list[Message]:
    """``messages`` with each ``<image>`` replaced by the model's image markup (``vision_text``); their number
    must equal the row's images."""
    found = sum(message["content"].count(IMAGE_PLACEHOLDER) for message in messages)
    if found != count:
        raise DataFormatError(f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) for {count} "
                              f"image(s); put one {IMAGE_PLACEHOLDER} where each image goes")
    return [{**message, "content": message["content"].replace(IMAGE_PLACEHOLDER, vision_text)} for message in messages]


class ImagePrompts:
    """Turns a rendered prompt and its images into the model's inputs, as Qwen2.5-VL's processor does: the model's
    image processor resizes and patches each image, and each image's pad token in the text becomes as many pad
    tokens as the vision tower makes features (patches / merge²). Only the image processor and the tokenizer are
    loaded (transformers' full processor also builds a video processor, which needs torchvision)."""

    def __init__(self, model_path: str, tokenizer: Any):
        self.tokenizer = tokenizer
        self.image_processor = _image_processor(model_path)
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.markup = f"{start}{self.image_token}{end}"
        """What one image is in the prompt text before its pad token is repeated."""

    def __call__(self, text: str, images: list, *, min_pixels: Optional[int], max_pixels: Optional[int],
                 add_special_tokens: bool):
        """``(prompt token ids, ImageInputs)`` of one rendered prompt and its images."""
        from rlmega.data.schema import ImageInputs

        size = dict(self.image_processor.size)  # {"shortest_edge": min pixels, "longest_edge": max pixels}
        size.update({key: value for key, value in (("shortest_edge", min_pixels), ("longest_edge", max_pixels))
                     if value})
        grids = self.image_processor(images=images, return_tensors="pt", size=size)["image_grid_thw"].long()
        # The patches are those of the images resized to their grids, which the engines get, patched within pixel
        # limits that keep each at its size (as vLLM is asked to: rlmega.rollout.vllm_engine): the processor's own
        # resize of the originals differs from PIL's in the last bits where it is torchvision's, while resizing an
        # image to its own size changes nothing in either backend, so both sides patch the same pixels. The
        # dataset's limits would not do: where they are close for an image's shape, the resized image's area falls
        # outside them and it would be resized again, to another grid.
        resized = self._resized(images, grids)
        encoded = self.image_processor(images=resized, return_tensors="pt", size=keeping_sizes(resized))
        if not encoded["image_grid_thw"].long().equal(grids):
            raise RuntimeError(f"{type(self.image_processor).__name__} changed the grids of images already resized to "
                               f"them ({grids.tolist()} -> {encoded['image_grid_thw'].tolist()}); rlmega's image "
                               "prompts need a Qwen2-VL-style processor, which keeps such images as they are")
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"{len(pieces) - 1} image tokens in the prompt for {len(images)} images")
        expanded = pieces[0] + "".join(self.image_token * int(grid.prod() // self.merge**2) + piece
                                       for grid, piece in zip(grids, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids), ImageInputs(encoded["pixel_values"].float(), grids, [_png(image) for image in resized])

    def _resized(self, images: list, grids) -> list:
        """Each image resized to its grid as the processor resizes (with its resampling): an engine's own processor
        then keeps the size, so it makes the same grid and patches."""
        patch = int(getattr(self.image_processor, "patch_size", 14))
        resample = getattr(self.image_processor, "resample", None)
        return [image.resize((width * patch, height * patch), resample=resample)
                for image, (_, height, width) in zip(images, grids.tolist())]


def keeping_sizes(images: list) -> dict:
    """Pixel limits under which Qwen2-VL's resize keeps every one of ``images`` (each already a whole number of
    merged patches) at its size: the smallest and largest of their areas."""
    areas = [image.size[0] * image.size[1] for image in images]
    return {"shortest_edge": min(areas), "longest_edge": max(areas)}


def _png(image) -> bytes:
    """Lossless bytes of ``image``, what the engines are sent."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_prompts_for(model_path: str, tokenizer_path: Optional[str], tokenizer: Any, *,
                      multi_turn: bool = False) -> Optional[ImagePrompts]:
    """A vision-language model's ``ImagePrompts`` (its image processor from ``tokenizer_path`` or ``model_path``);
    None for a text model. ``multi_turn``: agent rollouts, which do not take images yet (UserError)."""
    from transformers import AutoConfig

    from rlmega.errors import UserError
    from rlmega.models.vision_language import VISION_LANGUAGE_MODEL_TYPES

    if AutoConfig.from_pretrained(model_path).model_type not in VISION_LANGUAGE_MODEL_TYPES:
        return None
    if multi_turn:
        raise UserError("agent.enabled: multi-turn rollouts with a vision-language model are not supported yet")
    return ImagePrompts(tokenizer_path or model_path, tokenizer)


def _image_processor(model_path: str):
    """The checkpoint's image processor; without torchvision its PIL twin (transformers would pick that one itself,
    after a warning on the console)."""
    import importlib.util

    from transformers import AutoImageProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if importlib.util.find_spec("torchvision") is None:
        hf_logging.set_verbosity_error()
    try:
        return AutoImageProcessor.from_pretrained(model_path)
    finally:
        hf_logging.set_verbosity(verbosity)

"""Prompt datasets: schema-checked rows from files, rendered with the chat template, tokenized, length-limited."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from rlmega.data.files import out_of_memory, read_rows
from rlmega.data.images import place_images, read_images
from rlmega.data.schema import DataFormatError, Message, PromptRecord, parse_row
from rlmega.errors import UserError

TRUNCATION_MODES = ("error", "left", "right")
_ENCODE_CHUNK = 1024


@dataclass
class DataConfig:
    """Where prompts come from and how they become token ids."""

    files: list[str] = field(default_factory=list)
    """Dataset files (``.parquet`` or ``.jsonl``), read in order and concatenated."""
    max_prompt_length: int = 1024
    """Longest prompt, in tokens, after the chat template."""
    truncation: str = "error"
    """What to do with a longer prompt that is not filtered: ``error`` (stop, naming the row), ``left`` (keep the
    last ``max_prompt_length`` tokens) or ``right`` (keep the first ones)."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than ``max_prompt_length`` at load (counted in ``PromptDataset.num_filtered``);
    ``truncation`` then never applies."""
    use_chat_template: bool = True
    """Render messages with the tokenizer's chat template (with the generation prompt). Off: the text of the
    messages, joined by newlines, is tokenized as it is (with the tokenizer's own special tokens, e.g. BOS)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``{"enable_thinking": False}``)."""
    prompt_key: str = "prompt"
    """The column holding the prompt."""
    image_key: str = "images"
    """A vision-language model's: the column holding each row's images (``rlmega/data/images.py``)."""
    min_pixels: Optional[int] = None
    """A vision-language model's: images smaller than this (height x width) are scaled up (None: the processor's)."""
    max_pixels: Optional[int] = None
    """A vision-language model's: images larger than this are scaled down (None: the processor's)."""

    def __post_init__(self) -> None:
        if isinstance(self.files, (str, os.PathLike)):
            self.files = [self.files]
        self.files = [os.fspath(path) for path in self.files]
        if self.max_prompt_length < 1:
            raise ValueError(f"DataConfig.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"DataConfig.truncation must be one of {list(TRUNCATION_MODES)}, got {self.truncation!r}")


def prompt_text(messages: Sequence[Message], tokenizer: Any, use_chat_template: bool = True,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The text a prompt is tokenized from: the chat template with the generation prompt, or the raw contents."""
    if not use_chat_template:
        return "\n".join(message["content"] for message in messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat template; set DataConfig.use_chat_template=False to tokenize raw text"
        )
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )


class PromptDataset:
    """Every prompt of the configured files as a ``PromptRecord``, indexable and batchable.

    Rows are checked against the schema, rendered, tokenized, then filtered or truncated to
    ``max_prompt_length``; any error is a DataFormatError naming the file and row, and the settings
    of the config section ``config_key`` (``data`` or ``val_data``) that would fix it.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, *, config_key: str = "data", processor: Any = None):
        """``processor``: a vision-language model's ``rlmega.data.images.ImagePrompts``; rows' images are then
        read and processed, and each record carries them (``PromptRecord.images``)."""
        self.processor = processor
        if not config.files:
            raise ValueError("DataConfig.files: at least one dataset file is required")
        self.config = config
        self.config_key = config_key
        self.num_filtered = 0
        self.num_truncated = 0
        self.records: list[PromptRecord] = []
        if config.use_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise UserError(f"{config_key}.use_chat_template: the tokenizer has no chat template; set "
                            f"{config_key}.use_chat_template=false to tokenize the prompts' text as it is")
        for path in config.files:
            try:
                self._load_file(path, tokenizer)
            except MemoryError as error:  # rendering and tokenizing it (read_rows names the file itself)
                raise out_of_memory(path, error) from None
        if not self.records:
            raise DataFormatError(
                f"{config_key}.files: no prompts left: all {self.num_filtered} are longer than "
                f"{config_key}.max_prompt_length={config.max_prompt_length} and "
                f"{config_key}.filter_overlong_prompts=true drops them; raise {config_key}.max_prompt_length"
            )

    def _load_file(self, path: str, tokenizer: Any) -> None:
        config, key = self.config, self.config_key
        rows = read_rows(path)
        if not rows:
            raise DataFormatError(f"{path}: no rows (the file is empty); each file of {key}.files needs at least one "
                                  "prompt row")
        parsed = [parse_row(row, path, row_number, config.prompt_key, key) for row_number, row in enumerate(rows)]
        # A vision-language model's images, their <image> placeholders replaced by the model's markup.
        images = self._images(rows, parsed, path) if self.processor is not None else [None] * len(rows)
        texts = [
            prompt_text(row.messages, tokenizer, config.use_chat_template, config.chat_template_kwargs)
            for row in parsed
        ]
        token_ids: list[list[int]] = []
        for start in range(0, len(texts), _ENCODE_CHUNK):
            encoded = tokenizer(texts[start:start + _ENCODE_CHUNK], add_special_tokens=not config.use_chat_template)
            token_ids.extend(list(ids) for ids in encoded["input_ids"])
        for row_number, pictures in enumerate(images):
            if pictures:
                token_ids[row_number], images[row_number] = self.processor(
                    texts[row_number], pictures, min_pixels=config.min_pixels, max_pixels=config.max_pixels,
                    add_special_tokens=not config.use_chat_template)
            else:
                images[row_number] = None
        for row_number, (row, ids) in enumerate(zip(parsed, token_ids)):
            if not ids:
                raise DataFormatError(f"{path} row {row_number}: the prompt tokenizes to no tokens")
            ids = self._fit_length(ids, path, row_number, with_images=images[row_number] is not None)
            if ids is None:
                continue
            self.records.append(PromptRecord(
                index=len(self.records),
                prompt_token_ids=ids,
                messages=row.messages,
                data_source=row.data_source,
                ground_truth=row.ground_truth,
                reward_style=row.reward_style,
                extra_info=row.extra_info,
                source_file=path,
                source_row=row_number,
                images=images[row_number],
            ))

    def _images(self, rows: list, parsed: list, path: str) -> list[list]:
        """Each row's images (read, their placeholders in the parsed messages replaced by the image markup)."""
        key, base = self.config.image_key, os.path.dirname(os.path.abspath(path))
        markup = self.processor.markup
        images = []
        for row_number, (row, parsed_row) in enumerate(zip(rows, parsed)):
            where = f"{path} row {row_number}"
            pictures = read_images(row.get(key) if isinstance(row, dict) else None, where, base)
            parsed_row.messages = place_images(parsed_row.messages, len(pictures), where, markup)
            images.append(pictures)
        return images

    def _fit_length(self, ids: list[int], path: str, row_number: int, with_images: bool = False) -> list[int] | None:
        limit, key = self.config.max_prompt_length, self.config_key
        if len(ids) <= limit:
            return ids
        if self.config.filter_overlong_prompts:
            self.num_filtered += 1
            return None
        if with_images:  # cutting would separate image pad tokens from their image
            raise DataFormatError(
                f"{path} row {row_number}: the prompt with its images is {len(ids)} tokens, longer than "
                f"{key}.max_prompt_length={limit}, and a prompt with images cannot be truncated; set "
                f"{key}.max_pixels lower (fewer tokens per image), {key}.filter_overlong_prompts=true, or raise "
                f"{key}.max_prompt_length")
        if self.config.truncation == "error":
            raise DataFormatError(
                f"{path} row {row_number}: the prompt is {len(ids)} tokens, longer than "
                f"{key}.max_prompt_length={limit}; set {key}.truncation=left (keep its end) or "
                f"{key}.filter_overlong_prompts=true (skip such prompts), or raise {key}.max_prompt_length"
            )
        self.num_truncated += 1
        return ids[-limit:] if self.config.truncation == "left" else ids[:limit]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    def batch(self, indices: Sequence[int]) -> list[PromptRecord]:
        """The records at ``indices`` (e.g. one batch from ``StatefulSampler.next_batch``), in that order."""
        return [self.records[index] for index in indices]

    @property
    def data_sources(self) -> set[str]:
        """Every ``data_source`` in the dataset (to check the reward scorers up front)."""
        return {record.data_source for record in self.records}


@dataclass
class PromptDatasets:
    """A run's prompts, read and tokenized once: by the start-up checks (``rlmega.config.validate``), which hand them
    to the run (``rlmega.trainer.prompt_side.build_prompt_side``)."""

    train: PromptDataset
    val: Optional[PromptDataset] = None
    """None without validation (``trainer.val_every: 0``)."""

    @classmethod
    def read(cls, data: DataConfig, val_data: Optional[DataConfig], tokenizer: Any,
             processor: Any = None) -> PromptDatasets:
        """The ``data`` and ``val_data`` files (None: no validation set) as the run tokenizes them."""
        train = PromptDataset(data, tokenizer, config_key="data", processor=processor)
        val = None if val_data is None else PromptDataset(val_data, tokenizer, config_key="val_data",
                                                            processor=processor)
        return cls(train, val)

    def relocate(self, old_dir: str, new_dir: str) -> None:
        """The files were moved from ``old_dir`` to ``new_dir``: every record names its file where it is now."""
        old_dir = os.path.normpath(old_dir)
        for dataset in (d for d in (self.train, self.val) if d is not None):
            for record in dataset.records:
                source = os.path.normpath(record.source_file)
                if source == old_dir or source.startswith(old_dir + os.sep):
                    record.source_file = os.path.join(new_dir, os.path.relpath(source, old_dir))

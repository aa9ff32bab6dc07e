"""The row schema of prompt datasets (the one verl users already have) and the per-prompt record.

A row is a mapping with:

- ``prompt``: a list of chat messages ``[{"role": "user", "content": "..."}]``, or a plain string;
- ``data_source``: a string naming the task; it picks the reward scorer;
- ``reward_model``: a mapping with ``ground_truth`` (any JSON-like value) and optionally ``style``;
- ``extra_info``: an optional mapping (e.g. ``{"index": 3, "split": "train"}``), passed to the scorer. verl's
  multi-turn keys are read as they are: ``tools_kwargs`` (tool name -> that tool's kwargs, e.g.
  ``{"create_kwargs": {...}, "execute_kwargs": {...}}``, given to the tool's ``context`` argument) and
  ``interaction_kwargs`` (a mapping given to the environment's ``reset``); see rlmega/agent/README.md.

Other columns are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlmega.errors import UserError

if TYPE_CHECKING:  # the rows need no torch; only a vision-language record's images hold tensors
    import torch

Message = dict[str, str]


class DataFormatError(UserError):
    """A dataset file that cannot be used: a row that does not follow the schema, a file that does not
    parse; the message names the file, the row or line, and the field."""


@dataclass
class ImageInputs:
    """A sequence's images as a vision-language model takes them (``rlmega.models.vision_language``)."""

    pixel_values: torch.Tensor
    """``[patches, channels * temporal_patch * patch * patch]`` the images' patches, image after image."""
    grid_thw: torch.Tensor
    """``[images, 3]`` each image's patch grid (temporal, height, width), in the order of its pad tokens."""
    images: list[bytes] | None = None
    """Each image as PNG, resized to its grid (``grid_w * patch`` x ``grid_h * patch`` pixels): what an engine
    that takes only raw images (vLLM) re-processes into the same ``grid_thw`` and patches; None: not kept."""


@dataclass
class PromptRecord:
    """One prompt of a dataset, ready for rollout and scoring.

    ``index`` is the position in the dataset (after filtering), the key the sampler draws; ``source_file`` and
    ``source_row`` say where the row came from (``source_row`` counts from 0 among the file's data rows).
    """

    index: int
    prompt_token_ids: list[int]
    messages: list[Message]
    data_source: str
    ground_truth: Any
    reward_style: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    source_file: str = ""
    source_row: int = -1
    images: ImageInputs | None = None
    """A vision-language prompt's images as the model takes them (``ImageInputs``), their
    pad tokens in ``prompt_token_ids``; None: text only."""


@dataclass
class ParsedRow:
    """A row checked against the schema, before tokenization."""

    messages: list[Message]
    data_source: str
    ground_truth: Any
    reward_style: str | None
    extra_info: dict[str, Any]


def _where(source_file: str, source_row: int) -> str:
    return f"{source_file} row {source_row}"


def parse_messages(prompt: Any, where: str, prompt_key: str = "prompt") -> list[Message]:
    """A prompt field as chat messages: a string becomes one user message; a list must hold role/content dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataFormatError(
            f"{where}: field '{prompt_key}' must be a string or a non-empty list of chat messages, "
            f"got {type(prompt).__name__} {prompt!r:.80}"
        )
    messages = []
    for position, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise DataFormatError(
                f"{where}: field '{prompt_key}[{position}]' must be a mapping with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataFormatError(
                    f"{where}: field '{prompt_key}[{position}].{key}' must be a string, "
                    f"got {type(message.get(key)).__name__}"
                )
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def parse_row(row: Any, source_file: str, source_row: int, prompt_key: str = "prompt",
              config_key: str = "data") -> ParsedRow:
    """Check one row against the schema; a DataFormatError names the file, row and offending field
    (and, to fix it, the settings of the config section ``config_key``)."""
    where = _where(source_file, source_row)
    if not isinstance(row, Mapping):
        raise DataFormatError(f"{where}: a row must be a mapping of fields, got {type(row).__name__}")
    missing = [key for key in (prompt_key, "data_source", "reward_model") if key not in row or row[key] is None]
    if missing:
        fix = (f"if the prompt is in another column, set {config_key}.prompt_key to it" if prompt_key in missing
               else "every row needs the prompt, data_source and reward_model fields (rlmega/data/schema.py)")
        raise DataFormatError(f"{where}: missing field(s) {missing}; the row has {sorted(row)}; {fix}")
    messages = parse_messages(row[prompt_key], where, prompt_key)
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise DataFormatError(f"{where}: field 'data_source' must be a non-empty string, got {data_source!r:.80}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping):
        raise DataFormatError(
            f"{where}: field 'reward_model' must be a mapping with 'ground_truth', got {type(reward_model).__name__}"
        )
    if reward_model.get("ground_truth") is None:
        raise DataFormatError(f"{where}: missing field 'reward_model.ground_truth' (the answer the reward scorer "
                              "compares with); every row needs one")
    style = reward_model.get("style")
    if style is not None and not isinstance(style, str):
        raise DataFormatError(f"{where}: field 'reward_model.style' must be a string, got {type(style).__name__}")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise DataFormatError(f"{where}: field 'extra_info' must be a mapping, got {type(extra_info).__name__}")
    tools_kwargs = extra_info.get("tools_kwargs")
    if tools_kwargs is not None and not (isinstance(tools_kwargs, Mapping)
                                         and all(v is None or isinstance(v, Mapping) for v in tools_kwargs.values())):
        raise DataFormatError(f"{where}: field 'extra_info.tools_kwargs' must map each tool name to a mapping of its "
                              f"kwargs, got {tools_kwargs!r:.80}")
    interaction_kwargs = extra_info.get("interaction_kwargs")
    if interaction_kwargs is not None and not isinstance(interaction_kwargs, Mapping):
        raise DataFormatError(f"{where}: field 'extra_info.interaction_kwargs' must be a mapping, "
                              f"got {type(interaction_kwargs).__name__}")
    return ParsedRow(
        messages=messages,
        data_source=data_source,
        ground_truth=reward_model["ground_truth"],
        reward_style=style,
        extra_info=dict(extra_info),
    )

"""The Hugging Face side of a conversion: the base directory's config, the tensors that config
implies, and the non-weight files (config, generation config, tokenizer) of an exported model."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from converters.errors import ConversionError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.json",
    "chat_template.jinja", "preprocessor_config.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_base(hf_base: Path, *, mtp: str = "auto"):
    """(config dict, ModelSpec) of an HF model directory; one-line errors for what is wrong with it.

    Only weights are converted, so settings that only the forward pass uses (routing, RoPE) are not
    refused (``model_spec_from_hf(weights_only=True)``); ``mtp`` as there.
    """
    from rlmega.models import UnsupportedModelError, model_spec_from_hf, read_hf_config

    if not (Path(hf_base) / "config.json").is_file():
        raise ConversionError(f"{hf_base} has no config.json; pass the HF directory of the model the checkpoint was trained from")
    config = read_hf_config(hf_base)
    try:
        return config, model_spec_from_hf(Path(hf_base), mtp=mtp, weights_only=True)
    except UnsupportedModelError as error:
        raise ConversionError(f"{hf_base}/config.json: {error}") from None


def config_dtype(config: dict) -> torch.dtype:
    """The dtype config.json names (``dtype`` in transformers 5, ``torch_dtype`` before), else float32."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ConversionError(f"config.json names dtype {name!r}; pass --dtype {'/'.join(DTYPES)}")
    return DTYPES[name]


def expected_tensors(hf_base: Path, config: dict, *, with_tied_head: bool = False) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the safetensors that transformers' ``save_pretrained`` writes for the model
    ``config.json`` describes: the model is instantiated on the meta device (no memory), and
    transformers' own save-time conversion gives the on-disk names (per-expert MoE keys).
    ``with_tied_head``: keep the LM head of a config that ties it, for a source that stored it anyway."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import logging as hf_logging

    from rlmega.models.vision_language import VISION_LANGUAGE_MODEL_TYPES

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        hf_config = AutoConfig.from_pretrained(hf_base)
        loader = (AutoModelForImageTextToText if hf_config.model_type in VISION_LANGUAGE_MODEL_TYPES
                  else AutoModelForCausalLM)
        with torch.device("meta"):
            model = loader.from_config(hf_config)
        state = revert_weight_conversion(model, model.state_dict())
    except Exception as error:  # transformers' config validators raise several types
        cause = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ConversionError(
            f"transformers cannot build the model {hf_base}/config.json describes ({cause.strip()}); "
            "fix that config.json or pass another --hf-base"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if config.get("tie_word_embeddings") and not with_tied_head:
        shapes.pop("lm_head.weight", None)
    return shapes


def write_model_files(hf_base: Path, directory: Path, config: dict, dtype: torch.dtype) -> None:
    """config.json (its dtype set to the weights'), generation_config.json and the tokenizer files."""
    config = dict(config)
    dtype_name = str(dtype).removeprefix("torch.")
    for field in ("dtype", "torch_dtype"):
        if field in config:
            config[field] = dtype_name
    config.setdefault("dtype", dtype_name)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    generation = Path(hf_base) / "generation_config.json"
    if generation.is_file():
        shutil.copy2(generation, directory / generation.name)
    else:  # what transformers derives from the model config when a checkpoint has none
        fields = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (directory / generation.name).write_text(json.dumps(fields, indent=2) + "\n")

    for name in TOKENIZER_FILES:
        source = Path(hf_base) / name
        if source.is_file():
            shutil.copy2(source, directory / name)

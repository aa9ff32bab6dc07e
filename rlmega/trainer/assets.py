"""The quickstart's local assets: a tiny Llama-architecture model with a character tokenizer, and an
arithmetic dataset. Built on the machine (no downloads), once per directory."""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)


def prepare_tiny_assets(directory: str | os.PathLike, *, max_operand: int = 9, num_train: int = 2000,
                        num_val: int = 128, seed: int = 0) -> dict[str, str]:
    """Create (if missing) ``model/`` (HF checkpoint + tokenizer), ``train.parquet`` and ``val.parquet``
    under ``directory``; returns their paths. Writes to temporary names and renames when complete. Assets that
    exist cost nothing (transformers is only imported to build the model)."""
    from rlmega.data import write_arithmetic_dataset

    directory = Path(directory)
    paths = {"model": directory / "model", "train": directory / "train.parquet", "val": directory / "val.parquet"}
    directory.mkdir(parents=True, exist_ok=True)
    if not (paths["model"] / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from rlmega.data import build_char_tokenizer

        staging = directory / "model.tmp"
        tokenizer = build_char_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_MODEL)
        torch.manual_seed(seed)
        save_quietly(AutoModelForCausalLM.from_config(config).float(), staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, paths["model"])
    for split, rows, split_seed in (("train", num_train, seed + 1), ("val", num_val, seed + 2)):
        if not paths[split].is_file():
            staging = directory / f"{split}.tmp.parquet"
            write_arithmetic_dataset(staging, rows, seed=split_seed, max_operand=max_operand, split=split)
            os.replace(staging, paths[split])
    return {name: str(path) for name, path in paths.items()}


def save_quietly(model, directory: str | os.PathLike) -> None:
    """``model.save_pretrained(directory)`` without transformers' progress bar (for one tiny shard it is noise)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            hf_logging.enable_progress_bar()

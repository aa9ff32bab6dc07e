"""Prompt data for RL: verl-schema parquet/jsonl files, chat templates, length limits, a resumable sampler."""

from rlmega.data.dataset import TRUNCATION_MODES, DataConfig, PromptDataset, PromptDatasets, prompt_text
from rlmega.data.files import OutOfMemoryError, read_rows, write_rows
from rlmega.data.sampler import StatefulSampler
from rlmega.data.schema import DataFormatError, PromptRecord, parse_row
from rlmega.data.synthetic import ARITHMETIC_DATA_SOURCE, make_arithmetic_rows, write_arithmetic_dataset
from rlmega.data.tokenizer import build_char_tokenizer, save_char_tokenizer

__all__ = [
    "ARITHMETIC_DATA_SOURCE",
    "TRUNCATION_MODES",
    "DataConfig",
    "DataFormatError",
    "OutOfMemoryError",
    "PromptDataset",
    "PromptDatasets",
    "PromptRecord",
    "StatefulSampler",
    "build_char_tokenizer",
    "make_arithmetic_rows",
    "parse_row",
    "prompt_text",
    "read_rows",
    "save_char_tokenizer",
    "write_arithmetic_dataset",
    "write_rows",
]

"""Shared fixtures: tiny HF models and Megatron checkpoints saved from live models by gloo ranks.

The checkpoints are made once per session (each is a multi-rank job); tests that damage one work
on a copy.
"""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))  # hf_models: the bridge tests' tiny models

from converter_checkpoints import CASES, save_checkpoint  # noqa: E402
from hf_models import save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{arch: directory} of tiny random HF models saved by transformers, with stand-in tokenizer files."""
    saved = {}
    for arch in ("qwen3-moe", "qwen2-tied", "llama"):
        directory = tmp_path_factory.mktemp(f"hf-{arch}")
        save_tiny_model(arch, directory)
        (directory / "tokenizer.json").write_text('{"version": "1.0", "stand-in": true}\n')
        (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
        saved[arch] = directory
    return saved


@pytest.fixture(scope="session")
def checkpoints(hf_models, tmp_path_factory):
    """{case: (checkpoint root, live export)} for every entry of ``converter_checkpoints.CASES``."""
    return {
        name: save_checkpoint(hf_models[arch], tmp_path_factory.mktemp(f"ckpt-{name}"), layout)
        for name, (arch, layout) in CASES.items()
    }


@pytest.fixture
def dense_copy(checkpoints, tmp_path):
    """A private copy of the dense checkpoint's root, for tests that damage it."""
    root, _ = checkpoints["dense-tp2-pp2-vpp2"]
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    return copy

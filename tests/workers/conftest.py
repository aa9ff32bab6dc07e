import sys
from pathlib import Path

import pytest

# The tiny HF checkpoints of every architecture live with the bridge tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bridge"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny dense (Llama) and MoE (Qwen3-MoE) HF checkpoint."""
    from hf_models import save_tiny_model

    paths = {}
    for name in ("llama", "qwen3-moe"):
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(name, paths[name])
    return paths

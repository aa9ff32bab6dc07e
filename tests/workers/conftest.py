import sys
from pathlib import Path

import pytest

# The tiny HF checkpoints of every architecture live with the bridge tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bridge"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny dense (Llama), MoE (Qwen3-MoE) and MLA (DeepSeek-V3) HF checkpoint."""
    from deepseek_models import save_tiny_deepseek
    from hf_models import save_tiny_model

    paths = {}
    for name in ("llama", "qwen3-moe"):
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(name, paths[name])
    paths["deepseek-v3"] = tmp_path_factory.mktemp("deepseek-v3")
    save_tiny_deepseek("deepseek-v3", paths["deepseek-v3"])
    return paths

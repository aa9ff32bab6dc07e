"""Tiny checkpoints that real vLLM and SGLang can serve (head_dim 64, fp32-friendly): a Llama, a second one
with other weights for updates, a Qwen2 (attention biases) and a Qwen3-MoE (four experts, two per token,
q/k norms). ``gpu_model_dirs(kind, seed)`` makes any of them; ``ENGINE_MODELS`` names the kinds."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

from rlmega.trainer.assets import save_quietly

PROMPTS = [[5, 17, 33, 2, 71], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [88, 3]]


SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: LlamaConfig(intermediate_size=512, **SHAPE),
    "qwen2": lambda: Qwen2Config(intermediate_size=512, **SHAPE),
    "qwen3_moe": lambda: Qwen3MoeConfig(head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                        mlp_only_layers=[], **SHAPE),
}


def _save(directory, seed, kind="llama"):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind]()).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)  # peaked next-token distributions, so greedy decoding is stable
    save_quietly(model, directory)
    return directory


@pytest.fixture(scope="session")
def gpu_llama_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpu-llama-0"), 0)


@pytest.fixture(scope="session")
def gpu_llama_other_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpu-llama-1"), 1)


@pytest.fixture(scope="session")
def gpu_model_dirs(tmp_path_factory, gpu_llama_dir, gpu_llama_other_dir):
    """``gpu_model_dirs(kind, seed=0)``: a checkpoint of that kind (``CONFIGS``), made on first use; seed 1 gives
    other weights of the same shapes."""
    made = {("llama", 0): gpu_llama_dir, ("llama", 1): gpu_llama_other_dir}

    def directory(kind, seed=0):
        if (kind, seed) not in made:
            made[kind, seed] = _save(tmp_path_factory.mktemp(f"gpu-{kind}-{seed}"), seed, kind)
        return made[kind, seed]

    return directory


ENGINE_MODELS = sorted(CONFIGS)

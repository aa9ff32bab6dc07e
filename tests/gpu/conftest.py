"""A tiny Llama checkpoint that real vLLM and SGLang can serve (head_dim 64, fp32-friendly), and a second one
with other weights for updates."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

PROMPTS = [[5, 17, 33, 2, 71], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [88, 3]]


def _save(directory, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)  # peaked next-token distributions, so greedy decoding is stable
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def gpu_llama_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpu-llama-0"), 0)


@pytest.fixture(scope="session")
def gpu_llama_other_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpu-llama-1"), 1)

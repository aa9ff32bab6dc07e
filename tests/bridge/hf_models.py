"""Tiny random Hugging Face models of every supported architecture, saved as real checkpoints."""

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 100  # not a multiple of 128, so Megatron's vocabulary padding is exercised
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, rope_theta=500000.0),
    "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),  # head_dim != hidden / heads
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}


def save_tiny_model(name: str, directory, seed: int = 0) -> torch.Tensor:
    """Save a random model; return its fp32 logits on ``probe_tokens()``."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random small norms/biases, so a dropped or swapped one shows in the logits
        for pname, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in pname else 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(probe_tokens()).logits


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))

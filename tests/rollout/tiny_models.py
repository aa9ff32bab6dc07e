"""Tiny random Hugging Face models saved as real checkpoints, and the references the engine is checked against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MixtralConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
)

VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen3-moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # Learned absolute positions: unlike RoPE, shifting a row's positions changes its outputs, so
    # wrong position ids under left padding show.
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                               bos_token_id=1, eos_token_id=2),
}
# Prompts of different lengths, so left padding is exercised.
PROMPTS = [[5, 17, 33, 2, 71], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [88, 3]]


def save_tiny_model(name: str, directory: Path, seed: int) -> Path:
    """Save a random fp32 eager-attention model. Weights are larger than transformers' default init
    (std 0.02), so next-token distributions are peaked and different seeds give different outputs."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.dim() == 1:  # norm scales near 1, biases near 0
                is_norm = "norm" in pname or ".ln_" in pname
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if is_norm else 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return directory


def load_reference(directory: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32).eval()


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint under its on-disk name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def in_buckets(tensors: dict[str, torch.Tensor], num_buckets: int) -> list[list[tuple[str, torch.Tensor]]]:
    items = sorted(tensors.items())
    size = -(-len(items) // num_buckets)
    return [items[i:i + size] for i in range(0, len(items), size)]


def stream(buckets: list[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket


@torch.no_grad()
def teacher_forced_logprobs(model: PreTrainedModel, prompt: list[int], response: list[int],
                            temperature: float = 1.0) -> torch.Tensor:
    """log_softmax of the logits / temperature at each response token, from one forward pass of prompt + response: [R]."""
    tokens = torch.tensor([prompt + response])
    logits = model(tokens).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def greedy_reference(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                     stop_token_id: int | None = None) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt."""
    output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_token_id,
                            pad_token_id=0)
    return output[0, len(prompt):].tolist()

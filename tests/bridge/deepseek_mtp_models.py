"""A tiny random DeepSeek-V3 checkpoint with one multi-token-prediction (MTP) layer, and HF-module
reference MTP logits for it.

transformers neither builds nor saves DeepSeek's MTP layer, so ``save_pretrained``'s checkpoint is
augmented by hand, as DeepSeek's released checkpoint stores it: layer ``num_hidden_layers`` holds a
full MoE decoder layer plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the
embedding (``embed_tokens``) and LM head (``shared_head.head``).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from deepseek_models import TINY, save_tiny_deepseek

MTP_LAYER = TINY["num_hidden_layers"]  # HF's index of MTP layer 0
MTP_NORMS = ("enorm", "hnorm", "shared_head.norm")


def _random_like(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Random values of ``tensor``'s shape, spread as save_tiny_deepseek spreads them."""
    if name.endswith("e_score_correction_bias"):
        return 0.2 * torch.randn_like(tensor)
    if name.endswith("mlp.gate.weight"):
        return 0.3 * torch.randn_like(tensor)
    if tensor.dim() == 1 and "norm" in name:
        return 1.0 + 0.1 * torch.randn_like(tensor)
    return tensor.std() * torch.randn_like(tensor)


def mtp_tensors(saved: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Random MTP tensors for ``saved`` (a save_pretrained state dict), keyed as DeepSeek stores them."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    last_layer, mtp = f"model.layers.{MTP_LAYER - 1}.", f"model.layers.{MTP_LAYER}."
    tensors = {mtp + name[len(last_layer):]: _random_like(name, t) for name, t in saved.items() if name.startswith(last_layer)}
    hidden = saved["model.norm.weight"].shape[0]
    for norm in MTP_NORMS:
        tensors[f"{mtp}{norm}.weight"] = _random_like("norm", torch.empty(hidden))
    tensors[f"{mtp}eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden)
    tensors[f"{mtp}embed_tokens.weight"] = saved["model.embed_tokens.weight"].clone()
    tensors[f"{mtp}shared_head.head.weight"] = saved["lm_head.weight"].clone()
    torch.random.set_rng_state(generator_state)
    return tensors


def write_checkpoint(directory, tensors: dict[str, torch.Tensor], mtp_layers: int = 1) -> None:
    """Overwrite ``directory``'s model.safetensors and set num_nextn_predict_layers in config.json."""
    directory = Path(directory)
    save_file({name: t.contiguous() for name, t in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = mtp_layers
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def save_tiny_deepseek_mtp(directory, seed: int = 0) -> torch.Tensor:
    """Save the tiny DeepSeek-V3 with one MTP layer; return HF's fp32 main-model logits."""
    logits = save_tiny_deepseek("deepseek-v3", directory, seed)
    saved = load_file(Path(directory) / "model.safetensors")
    write_checkpoint(directory, {**saved, **mtp_tensors(saved)})
    return logits


@torch.no_grad()
def reference_mtp_logits(directory, tokens: torch.Tensor) -> torch.Tensor:
    """MTP layer 0's logits ``[b, s, vocab]`` as DeepSeek-V3 defines them, from HF's own modules.

    Position i combines the main model's final (normed) hidden state at i with the embedding of token
    i + 1 (token 0 past the end, as Megatron's roll pads): ``eh_proj([enorm(emb); hnorm(h)])``,
    then decoder layer ``num_hidden_layers`` at the same positions, ``shared_head.norm`` and
    ``shared_head.head``.
    """
    tensors = load_file(Path(directory) / "model.safetensors")
    mtp = f"model.layers.{MTP_LAYER}."
    main = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    # One more decoder layer: transformers loads model.layers.{MTP_LAYER}.* into it (experts included).
    extended = AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", num_hidden_layers=MTP_LAYER + 1
    ).float().eval()
    eps = main.config.rms_norm_eps
    norms = {}
    for norm in MTP_NORMS:
        norms[norm] = DeepseekV3RMSNorm(main.config.hidden_size, eps=eps)
        norms[norm].weight.copy_(tensors[f"{mtp}{norm}.weight"])

    hidden = main.model(tokens).last_hidden_state
    next_tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    embedded = torch.nn.functional.embedding(next_tokens, tensors[f"{mtp}embed_tokens.weight"])
    x = torch.cat([norms["enorm"](embedded), norms["hnorm"](hidden)], dim=-1) @ tensors[f"{mtp}eh_proj.weight"].T
    seq = tokens.shape[1]
    positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    x = extended.model.layers[MTP_LAYER](
        x, attention_mask=causal, position_ids=positions, position_embeddings=extended.model.rotary_emb(x, positions)
    )
    return norms["shared_head.norm"](x) @ tensors[f"{mtp}shared_head.head.weight"].T

"""Tiny random DeepSeek-V3 models, saved with transformers' own ``save_pretrained``."""

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from hf_models import VOCAB

TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64,
    num_nextn_predict_layers=0,  # MTP has its own tests (test_deepseek_mtp.py)
)

VARIANTS = {
    "deepseek-v3": dict(),
    # No q compression: HF's q_proj, Megatron's linear_q_proj.
    "deepseek-v3-no-q-lora": dict(q_lora_rank=None),
    # YaRN as DeepSeek-V3 ships it (mscale = mscale_all_dim), scaled down to the tiny context.
    "deepseek-v3-yarn": dict(
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
        ),
    ),
}


def tiny_config(variant: str = "deepseek-v3", **overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**TINY, **VARIANTS[variant], **overrides})


def save_tiny_deepseek(variant: str, directory, seed: int = 0) -> torch.Tensor:
    """Save a random model; return its fp32 logits on ``hf_models.probe_tokens()``.

    Norm weights, the routers' score-correction biases and the router weights are randomised
    with large enough spread that a dropped, swapped or mis-sharded one changes which experts
    are picked, and so the logits.
    """
    from hf_models import probe_tokens

    torch.manual_seed(seed)
    config = tiny_config(variant)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.randn_like(tensor))
            elif name.endswith("mlp.gate.weight"):
                tensor.copy_(0.3 * torch.randn_like(tensor))
            elif tensor.dim() == 1 and "norm" in name:
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(probe_tokens()).logits

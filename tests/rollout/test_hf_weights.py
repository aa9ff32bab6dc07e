"""HFWeightMap name resolution on models that need no checkpoint: tied weights and persistent buffers."""

import pytest
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen2Config

from rlmega.rollout import HFWeightMap, UnknownWeightError

from .tiny_models import COMMON


def test_tied_lm_head_writes_the_embedding_and_is_not_required():
    model = AutoModelForCausalLM.from_config(Qwen2Config(**COMMON, tie_word_embeddings=True))
    weights = HFWeightMap(model)
    assert weights.resolve("lm_head.weight") == weights.resolve("model.embed_tokens.weight")
    assert "lm_head.weight" not in weights.slots and "model.embed_tokens.weight" in weights.slots


def test_persistent_buffers_are_weights_and_per_expert_names_map_into_fused_tensors():
    config = DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16)
    weights = HFWeightMap(AutoModelForCausalLM.from_config(config))
    bias = weights.resolve("model.layers.1.mlp.gate.e_score_correction_bias")
    assert (bias.tensor_name, bias.shape) == ("model.layers.1.mlp.gate.e_score_correction_bias", (4,))
    up = weights.resolve("model.layers.1.mlp.experts.3.up_proj.weight")
    assert (up.tensor_name, up.index, up.shape) == ("model.layers.1.mlp.experts.gate_up_proj", (3, slice(32, 64)),
                                                     (32, 64))
    fused = weights.resolve("model.layers.1.mlp.experts.down_proj")
    assert fused.index == () and len(fused.slots) == 4
    with pytest.raises(UnknownWeightError, match="'model.layers.1.mlp.experts.4.up_proj.weight'"):
        weights.resolve("model.layers.1.mlp.experts.4.up_proj.weight")

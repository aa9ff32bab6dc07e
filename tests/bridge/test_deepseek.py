"""DeepSeek-V3: HF config -> ModelSpec, the MLA core attention, and exact HF <-> Megatron round trips.

The round trips follow test_bridge_roundtrip: a tiny random HF model saved with ``save_pretrained``
is imported into Megatron-Core in a parallel layout, run forward, and streamed back out; logits
must match HF's and the export must be bit-identical to the saved safetensors.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepseek_models import VARIANTS, save_tiny_deepseek, tiny_config
from rlmega.models import UnsupportedModelError, has_transformer_engine, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout
from rlmega.parallel.spawn import run_on_ranks
from test_bridge_roundtrip import TIMEOUT_S, _import_run_export, _world_size, assert_round_trip


def _hf_dict(variant: str = "deepseek-v3", **overrides) -> dict:
    config = tiny_config(variant, **overrides)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config.to_dict()


# ---------------------------------------------------------------- config -> ModelSpec


def test_spec_maps_mla_router_shared_experts_and_dense_layers():
    spec = model_spec_from_hf(_hf_dict())
    c = spec.config
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.vocab_size == 100
    assert c["multi_latent_attention"] is True
    assert (c["q_lora_rank"], c["kv_lora_rank"]) == (32, 16)
    assert (c["qk_head_dim"], c["qk_pos_emb_head_dim"], c["v_head_dim"]) == (16, 8, 16)
    assert c["qk_layernorm"] is True  # builds the q/kv latent norms
    assert (c["rope_type"], c["rotary_base"], c["mscale_all_dim"]) == ("rope", 10000.0, 0.0)
    assert c["ffn_hidden_size"] == 96 and c["moe_ffn_hidden_size"] == 32
    assert c["moe_shared_expert_intermediate_size"] == 32
    assert c["moe_layer_freq"] == [0, 1, 1, 1]
    assert (c["num_moe_experts"], c["moe_router_topk"]) == (4, 2)
    assert c["moe_router_score_function"] == "sigmoid" and c["moe_router_enable_expert_bias"] is True
    assert (c["moe_router_num_groups"], c["moe_router_group_topk"]) == (2, 1)
    assert c["moe_router_topk_scaling_factor"] == 2.5


def test_spec_builds_an_mla_transformer_config():
    from megatron.core.transformer import MLATransformerConfig

    config = model_spec_from_hf(_hf_dict()).transformer_config(ParallelLayout(world_size=1))
    assert isinstance(config, MLATransformerConfig)
    assert config.multi_latent_attention and config.q_lora_rank == 32 and config.rope_type == "rope"


def test_spec_without_q_compression_and_with_a_single_group():
    c = model_spec_from_hf(_hf_dict("deepseek-v3-no-q-lora", n_group=1, topk_group=1)).config
    assert c["q_lora_rank"] is None
    assert "moe_router_num_groups" not in c and "moe_router_group_topk" not in c


def test_spec_maps_yarn_rope():
    c = model_spec_from_hf(_hf_dict("deepseek-v3-yarn")).config
    assert c["rope_type"] == "yarn"
    assert (c["rotary_scaling_factor"], c["original_max_position_embeddings"]) == (4.0, 16)
    assert (c["beta_fast"], c["beta_slow"], c["mscale"], c["mscale_all_dim"]) == (32.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("overrides, message", [
    (dict(rms_norm_eps=1e-5), r"rms_norm_eps=1e-05"),
    (dict(norm_topk_prob=False), r"norm_topk_prob=False with num_experts_per_tok=2"),
    (dict(num_experts_per_tok=4, n_group=2, topk_group=1), r"num_experts_per_tok=4 with topk_group=1"),
    (dict(rope_interleave=False), r"rope_interleave=false"),
    (dict(attention_bias=True), r"attention_bias=true"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), r"rope_type='linear'"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                               mscale_all_dim=1.0)), r"mscale=None, mscale_all_dim=1.0"),
])
def test_spec_refuses_what_megatron_cannot_reproduce(overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_spec_from_hf(_hf_dict(**overrides))


# ---------------------------------------------------------------- weight names


def test_megatron_names_resolve_to_the_hf_names_save_pretrained_writes():
    from rlmega.bridge.mapping import GATE_UP, RuleBook, canonical_te_name

    book = RuleBook("DeepseekV3ForCausalLM")
    expected = {
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": "model.layers.0.self_attn.q_a_proj.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight": "model.layers.0.self_attn.q_a_layernorm.weight",
        "decoder.layers.0.self_attention.linear_q_up_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
        "decoder.layers.0.self_attention.linear_q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "decoder.layers.0.self_attention.linear_kv_down_proj.weight": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "decoder.layers.0.self_attention.kv_layernorm.weight": "model.layers.0.self_attn.kv_a_layernorm.weight",
        "decoder.layers.0.self_attention.linear_kv_up_proj.weight": "model.layers.0.self_attn.kv_b_proj.weight",
        "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
        "decoder.layers.3.mlp.router.weight": "model.layers.3.mlp.gate.weight",
        "decoder.layers.3.mlp.router.expert_bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "decoder.layers.3.mlp.shared_experts.linear_fc2.weight": "model.layers.3.mlp.shared_experts.down_proj.weight",
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc2.weight": "model.layers.3.mlp.experts.2.down_proj.weight",
    }
    for megatron, hf in expected.items():
        assert book.resolve(megatron)[1] == (hf,), megatron
    rule, names = book.resolve("decoder.layers.3.mlp.shared_experts.linear_fc1.weight")
    assert rule.transform == GATE_UP
    assert names == ("model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight")
    # The TE spec fuses the latent norms into the up projections.
    assert canonical_te_name("decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight") == \
        "decoder.layers.2.self_attention.q_layernorm.weight"
    assert canonical_te_name("decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight") == \
        "decoder.layers.2.self_attention.kv_layernorm.weight"


# ---------------------------------------------------------------- MLA core attention


def _reference_attention(q, k, v, scale, blocked_keys=()):
    """softmax(q k^T * scale + causal mask) v, one head at a time; [s, b, n, d] in, [s, b, n * dv] out.

    ``blocked_keys``: key positions no query may attend to (a padding mask), on top of causality.
    """
    s, b, n, _ = q.shape
    out = torch.empty(s, b, n, v.shape[-1], dtype=q.dtype)
    mask = torch.full((s, s), float("-inf")).triu(1)
    mask[:, list(blocked_keys)] = float("-inf")
    for batch in range(b):
        for head in range(n):
            scores = q[:, batch, head] @ k[:, batch, head].T * scale + mask
            out[:, batch, head] = torch.softmax(scores, dim=-1) @ v[:, batch, head]
    return out.reshape(s, b, n * v.shape[-1])


def test_torch_core_attention_matches_explicit_causal_softmax_with_distinct_head_sizes():
    from megatron.core.transformer.enums import AttnMaskType

    from rlmega.models.core_attention import TorchCoreAttention

    config = model_spec_from_hf(_hf_dict()).transformer_config(ParallelLayout(world_size=1))
    scale = 0.123
    attention = TorchCoreAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        softmax_scale=scale, k_channels=24, v_channels=16,
    ).eval()
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(7, 2, 4, 24, generator=generator) for _ in range(2))
    v = torch.randn(7, 2, 4, 16, generator=generator)
    expected = _reference_attention(q, k, v, scale)
    assert (attention(q, k, v, None) - expected).abs().max().item() <= 1e-6
    # Without the causal mask the answer must change: the mask is really applied.
    unmasked = attention(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    assert (unmasked - expected).abs().max().item() > 1e-2
    # A given mask (True = blocked) is applied on top of causality; query 0 keeps key 0, its only one.
    padding = torch.zeros(1, 1, 7, 7, dtype=torch.bool)
    padding[..., 1:, 0] = True
    padded = _reference_attention(q, k, v, scale, blocked_keys=[0])
    padded[0] = expected[0]
    assert (attention(q, k, v, padding) - padded).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="expected q/k head size 24 and v head size 16"):
        attention(q, k, k, None)


def test_cpu_platform_maps_cuda_device_objects_to_the_cpu():
    """YaRN RoPE builds its tables under ``with torch.device(torch.cuda.current_device())``."""
    from rlmega.parallel.cpu_platform import CudaAsCpu

    with CudaAsCpu():
        devices = [torch.device(0), torch.device("cuda"), torch.device("cuda", 0), torch.device(type="cuda")]
        with torch.device(0):
            made = torch.zeros(1)
        kept = torch.device("meta")
    assert [device.type for device in devices] == ["cpu"] * 4 and made.device.type == "cpu"
    assert kept.type == "meta"
    assert torch.device("cuda").type == "cuda"  # nothing leaks outside the mode


def _mla_have_te_flag(rank, world_size):
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention.HAVE_TE


@pytest.mark.skipif(has_transformer_engine(), reason="transformer-engine is installed: MLA's HAVE_TE is right")
def test_cpu_platform_tells_mla_that_transformer_engine_is_absent():
    """Megatron's MLA calls isinstance() with TE's MagicMock stand-in unless HAVE_TE is corrected."""
    assert run_on_ranks(_mla_have_te_flag, 1, timeout_s=60) == [False]


# ---------------------------------------------------------------- HF <-> Megatron round trips

LAYOUTS = {
    "tp1": dict(),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2-vpp2": dict(pp=2, vpp=2),
    "ep2": dict(ep=2),
    "tp2-ep2": dict(tp=2, ep=2),
    "tp2-pp2": dict(tp=2, pp=2),  # tp=2 alone also splits the experts (etp follows tp without ep)
}
CASES = [("deepseek-v3", name, layout) for name, layout in LAYOUTS.items()]
CASES += [("deepseek-v3-no-q-lora", "tp2", LAYOUTS["tp2"]), ("deepseek-v3-yarn", "tp1", LAYOUTS["tp1"])]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    saved = {}
    for variant in VARIANTS:
        directory = tmp_path_factory.mktemp(variant)
        saved[variant] = (directory, save_tiny_deepseek(variant, directory))
    return saved


@pytest.mark.parametrize("variant, layout_name, layout_kwargs", CASES, ids=[f"{v}-{n}" for v, n, _ in CASES])
def test_deepseek_import_matches_hf_logits_and_export_is_bit_identical(variant, layout_name, layout_kwargs, hf_checkpoints):
    directory, hf_logits = hf_checkpoints[variant]
    layout = ParallelLayout(world_size=_world_size(layout_kwargs), **layout_kwargs)
    results = run_on_ranks(_import_run_export, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(directory), 16 * 1024))

    assert_round_trip(results, directory, hf_logits)
    assert any(name.endswith("e_score_correction_bias") for name in load_file(Path(directory) / "model.safetensors"))

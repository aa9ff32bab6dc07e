"""Per-engine-rank bytes of a weight update (rlmega.rollout.engine_bytes): hand-counted on tiny configs,
the tensor list against real HF checkpoints, the numbers printed in rlmega/sync/README.md, and the region each
rank holds against its count."""

import json
import math

import pytest
from safetensors import safe_open

from rlmega.rollout.engine_bytes import (EXPERT_COLUMN, EXPERT_ROW, KV_COLUMN, REPLICATED, EngineLayout,
                                      engine_rank_bytes, held_numel, held_region, hf_tensors)

# One MoE layer of a tiny Qwen3-MoE: 1 KV head (replicated over TP=2), 4 experts.
TINY_MOE = dict(model_type="qwen3_moe", hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2,
                intermediate_size=8, vocab_size=10, decoder_sparse_step=1, mlp_only_layers=[],
                tie_word_embeddings=False)

# The published config.json values of the models in the README table.
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936, decoder_sparse_step=1,
                     mlp_only_layers=[], tie_word_embeddings=False)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                   intermediate_size=18432, n_routed_experts=256, moe_intermediate_size=2048, n_shared_experts=1,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, moe_layer_freq=1,
                   topk_method="noaux_tc", num_nextn_predict_layers=1, tie_word_embeddings=False)

# (model, tp, ep, dp) -> (whole bytes, sliced bytes of every rank): the README's table.
README_TABLE = {
    ("Qwen3-30B-A3B", 4, 1, 1): (61_064_245_248, 15_285_252_096),
    ("Qwen3-30B-A3B", 2, 4, 2): (61_064_245_248, 16_049_401_856),
    ("DeepSeek-V3", 8, 8, 1): (1_342_052_838_400, 169_560_714_240),
    ("DeepSeek-V3", 1, 16, 16): (1_342_052_838_400, 115_973_893_120),
}
CONFIGS = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "DeepSeek-V3": DEEPSEEK_V3}


def test_tiny_moe_counted_by_hand_tp2_ep2():
    # elements: embed 40 + lm_head 40 + final norm 4, and per layer: norms 4+4, q 16, k 8, v 8, o 16,
    # q/k norms 2+2, router 16, experts 4 x (8+8+8) = 96  ->  84 + 2 x 172 = 428.
    # Per rank: vocab halves 20+20, norms whole; q and o halves (8 each); the one KV head whole on both
    # ranks (8 each); 2 of the 4 experts (48)  ->  44 + 2 x 108 = 260.
    result = engine_rank_bytes(TINY_MOE, EngineLayout(tensor_parallel_size=2, expert_parallel_size=2,
                                                      dtype_bytes=2))
    assert result.whole == 428 * 2
    assert result.sliced == (260 * 2, 260 * 2)
    # The sum over ranks is the model plus the second copy of what both ranks hold whole: norms and
    # router (2 x (4+4+2+2+16) + 4 = 60) and the replicated KV head (2 x 16 = 32).
    assert sum(result.sliced) == (428 + 60 + 32) * 2


def test_tiny_moe_counted_by_hand_dp_attention():
    # TP1 x DP2 with EP2: each rank holds all attention, norms and embeddings, and half the experts.
    result = engine_rank_bytes(TINY_MOE, EngineLayout(tensor_parallel_size=1, expert_parallel_size=2,
                                                      data_parallel_size=2, dtype_bytes=1))
    assert result.whole == 428
    assert result.sliced == (428 - 96, 428 - 96)
    assert sum(result.sliced) == 2 * (428 - 2 * 96) + 2 * 96


def _replication(tensor, layout):
    """How many whole copies of ``tensor`` the engine's ranks hold together, worked out independently."""
    tp, dp = layout.tensor_parallel_size, layout.data_parallel_size
    if tensor.split == REPLICATED:
        return tp * dp
    if tensor.split in (EXPERT_COLUMN, EXPERT_ROW):
        return 1
    if tensor.split == KV_COLUMN:
        return dp * tp * max(1, tensor.num_kv_heads // tp) / tensor.num_kv_heads
    return dp


@pytest.mark.parametrize("model, tp, ep, dp", list(README_TABLE), ids=lambda v: str(v))
def test_sum_over_ranks_is_the_model_times_replication(model, tp, ep, dp):
    layout = EngineLayout(tp, ep, dp)
    result = engine_rank_bytes(CONFIGS[model], layout)
    expected = sum(t.numel * _replication(t, layout) for t in hf_tensors(CONFIGS[model])) * layout.dtype_bytes
    assert sum(result.sliced) == expected


@pytest.mark.parametrize("model, tp, ep, dp", list(README_TABLE), ids=lambda v: str(v))
def test_the_readme_table(model, tp, ep, dp):
    result = engine_rank_bytes(CONFIGS[model], EngineLayout(tp, ep, dp, dtype_bytes=2))
    whole, sliced = README_TABLE[model, tp, ep, dp]
    assert result.whole == whole
    assert set(result.sliced) == {sliced}


def test_published_parameter_counts():
    # Qwen3-30B-A3B: 30.5B parameters; DeepSeek-V3: 671B without its 14B MTP module.
    assert round(engine_rank_bytes(QWEN3_30B_A3B, EngineLayout(dtype_bytes=1)).whole / 1e9, 1) == 30.5
    assert round(engine_rank_bytes(DEEPSEEK_V3, EngineLayout(dtype_bytes=1)).whole / 1e9) == 671


def test_layouts_that_cannot_hold_the_experts_are_refused():
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide"):
        EngineLayout(tensor_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ValueError, match="must divide the 4 experts"):
        engine_rank_bytes(TINY_MOE, EngineLayout(tensor_parallel_size=8, expert_parallel_size=8))


def _tiny_deepseek_v3():
    return dict(model_type="deepseek_v3", hidden_size=16, num_hidden_layers=3, first_k_dense_replace=1,
                intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                n_shared_experts=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                v_head_dim=4, num_attention_heads=2, num_key_value_heads=2, vocab_size=32, moe_layer_freq=1,
                topk_method="noaux_tc", n_group=1, topk_group=1, num_nextn_predict_layers=0,
                tie_word_embeddings=False, max_position_embeddings=64)


@pytest.mark.parametrize("config", [TINY_MOE, _tiny_deepseek_v3(),
                                    dict(model_type="llama", hidden_size=16, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                                         vocab_size=32, tie_word_embeddings=True)],
                         ids=["qwen3_moe", "deepseek_v3", "llama-tied"])
def test_tensors_are_those_of_a_real_checkpoint(config, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    on_disk = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as reader:
            on_disk |= {name: tuple(reader.get_slice(name).get_shape()) for name in reader.keys()}
    listed = {t.name: t.shape for t in hf_tensors(json.loads((tmp_path / "config.json").read_text()))}
    assert listed == on_disk


# A DeepSeek-V3 cut down to a few layers and experts: MLA, a dense first layer, shared experts, the score bias.
SMALL_DEEPSEEK = dict(DEEPSEEK_V3, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16)
REGION_CASES = [(TINY_MOE, 2, 2, 1), (TINY_MOE, 1, 2, 2), (TINY_MOE, 4, 1, 1), (TINY_MOE, 2, 4, 2),
                (QWEN3_30B_A3B, 4, 1, 1), (QWEN3_30B_A3B, 8, 8, 2), (SMALL_DEEPSEEK, 8, 1, 1), (SMALL_DEEPSEEK, 4, 8, 2)]


def _numel(box):
    return math.prod(stop - start for start, stop in box)


def _overlap(a, b):
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


@pytest.mark.parametrize("config, tp, ep, dp", REGION_CASES, ids=lambda v: str(v) if isinstance(v, int) else "")
def test_each_rank_holds_a_region_of_held_numel_and_the_ranks_tile_each_tensor(config, tp, ep, dp):
    """The region a rank holds has held_numel elements; the distinct regions of one data-parallel replica's
    ranks (experts: of every rank, as vLLM's expert parallelism spans TP x DP) tile the tensor: no overlap, no gap."""
    layout = EngineLayout(tp, ep, dp)
    for tensor in hf_tensors(config):
        regions = [held_region(tensor, layout, rank) for rank in range(layout.world_size)]
        for rank, region in enumerate(regions):
            assert (0 if region is None else _numel(region)) == held_numel(tensor, layout, rank), (tensor.name, rank)
            assert region is None or all(0 <= start < stop <= size for (start, stop), size in zip(region, tensor.shape))
        expert = tensor.split in (EXPERT_COLUMN, EXPERT_ROW)
        for replica in range(1 if expert else dp):
            ranks = range(layout.world_size) if expert else range(replica * tp, (replica + 1) * tp)
            distinct = list(dict.fromkeys(regions[rank] for rank in ranks if regions[rank] is not None))
            assert sum(_numel(box) for box in distinct) == tensor.numel, tensor.name
            assert not any(_overlap(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]), tensor.name

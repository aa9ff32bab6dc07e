"""An FP8 engine's tensor parallelism must cut every blockwise-quantized layer into whole 128-blocks (vLLM and SGLang
refuse the checkpoint at load otherwise): checked when the config loads, naming the layer, its size, the TP and the
TP sizes that work."""

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.rollout.fp8_slices import fp8_tp_problem
from tests.trainer.test_config_errors import run_dir  # noqa: F401 (the fixture)

QWEN3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288}
LLAMA2_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008}
QWEN3_30B_A3B = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "num_experts": 128, "moe_intermediate_size": 768}
DEEPSEEK_V3 = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
               "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128}


def _working(config, expert_parallel=False):
    return [tp for tp in range(1, 9) if fp8_tp_problem(config, tp, expert_parallel) is None]


def test_which_tp_sizes_cut_whole_blocks():
    assert _working(QWEN3_8B) == [1, 2, 4, 8]  # 3, 5, 6, 7 do not even divide the 32 heads
    assert _working(LLAMA2_7B) == [1, 2]  # 11008 / 4 = 2752 = 21.5 blocks
    assert _working(QWEN3_30B_A3B) == [1, 2]  # the experts' 768 / 4 = 192
    assert _working(QWEN3_30B_A3B, expert_parallel=True) == [1, 2, 4, 8]  # whole experts on each rank
    assert fp8_tp_problem(DEEPSEEK_V3, 8) is None and fp8_tp_problem(DEEPSEEK_V3, 16) is None


def test_the_refusal_names_the_layer_its_size_the_tp_and_what_works():
    assert fp8_tp_problem(LLAMA2_7B, 4) == (
        "rollout.weight_dtype=fp8 quantizes mlp.gate_proj in 128 x 128 blocks, and tensor_parallel_size=4 cuts its "
        "11008 output rows into slices of 2752, not a multiple of 128 (the engine refuses it at load); set "
        "rollout.tensor_parallel_size to a size that cuts whole blocks (1, 2), or set rollout.weight_dtype=auto")
    assert "spread the experts with rollout.expert_parallel_size" in fp8_tp_problem(QWEN3_30B_A3B, 4)
    assert "self_attn.q_proj" in fp8_tp_problem(QWEN3_8B, 3) and "into unequal slices" in fp8_tp_problem(QWEN3_8B, 3)
    few_kv_heads = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 64,
                    "intermediate_size": 8192}  # k: 2 heads x 64 = one block, halved by TP 2
    assert "self_attn.k_proj in 128 x 128 blocks, and tensor_parallel_size=2 cuts its 128 output rows into slices " \
           "of 64" in fp8_tp_problem(few_kv_heads, 2)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_config_load_refuses_an_engine_tp_that_splits_blocks(run_dir, backend):  # noqa: F811
    # The quickstart's tiny model: k is 64 rows (2 heads of 32), half a block: no engine TP serves it in FP8.
    with pytest.raises(UserError) as error:
        load_config("tiny_cpu", [f"run_dir={run_dir}", f"rollout.backend={backend}", "rollout.weight_dtype=fp8"])
    assert str(error.value) == (
        "rollout.tensor_parallel_size: rollout.weight_dtype=fp8 quantizes self_attn.k_proj in 128 x 128 blocks, and "
        "tensor_parallel_size=1 cuts its 64 output rows into slices of 64, not a multiple of 128 (the engine refuses "
        "it at load); set rollout.tensor_parallel_size to a size that cuts whole blocks (none up to 64), or set "
        "rollout.weight_dtype=auto")
    load_config("tiny_cpu", [f"run_dir={run_dir}", "rollout.backend=hf", "rollout.weight_dtype=fp8"])  # not split

"""The planner with ``rollout.weight_dtype=fp8``: engine weights and sync bytes at blockwise FP8."""

from pathlib import Path

import pytest

from rlmega.config import load_config
from rlmega.plan import make_plan
from rlmega.plan.report import render
from rlmega.rollout.engine_bytes import EngineLayout, engine_rank_bytes, hf_tensors

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "configs/recipes/qwen3_30b_a3b/dapo.yaml"
TINY_DENSE = dict(hidden_size=256, vocab_size=1000, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=640, model_type="qwen3", tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the checkout


def test_engine_bytes_count_fp8_weights_and_their_scales():
    bf16 = engine_rank_bytes(TINY_DENSE, EngineLayout(tensor_parallel_size=2))
    fp8 = engine_rank_bytes(TINY_DENSE, EngineLayout(tensor_parallel_size=2, weight_dtype="fp8"))
    linear = [t for t in hf_tensors(TINY_DENSE)
              if len(t.shape) == 2 and "embed" not in t.name and "lm_head" not in t.name]
    # q/o [256, 256]: 2x2 scales; k/v [128, 256]: 1x2; gate/up [640, 256]: 5x2; down [256, 640]: 2x5 (per layer)
    scales = 2 * 4 * (4 + 4 + 2 + 2 + 10 + 10 + 10)
    linear_numel = sum(t.numel for t in linear)
    assert bf16.whole - fp8.whole == linear_numel - scales  # one byte less per element, plus the scales
    assert sum(fp8.sliced) - fp8.whole == sum(bf16.sliced) - bf16.whole  # the replicated norms stay bf16
    assert max(fp8.sliced) < 0.75 * max(bf16.sliced)


def test_fp8_plan_halves_engine_weights_and_sync_bytes():
    plain = make_plan(load_config(RECIPE, check=False), RECIPE)
    fp8 = make_plan(load_config(RECIPE, ["rollout.weight_dtype=fp8"], check=False), RECIPE)
    assert 0.5 < fp8.engine.weights / plain.engine.weights < 0.52
    assert fp8.engine.kv_tokens > plain.engine.kv_tokens  # the memory freed goes to the KV cache
    assert 0.5 < fp8.refit.bytes_per_sync / plain.refit.bytes_per_sync < 0.52
    assert fp8.positions[0].roles["actor"].params == plain.positions[0].roles["actor"].params  # training is bf16
    assert f"weights {fp8.engine.weights / 2**30:.2f} GiB in fp8," in render(fp8)
    assert " in fp8" not in render(plain)

"""`rlmega plan` of a LoRA actor with ``sync.lora=adapters``: the refit streams the adapters' bytes (PEFT form, the
actor's dtype), not the merged model's, and the report says so."""

from pathlib import Path

import pytest

from rlmega.cli.main import main
from rlmega.config import load_config
from rlmega.plan import make_plan

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = "configs/recipes/qwen3_8b/grpo.yaml"
ADAPTERS = ["actor.lora.rank=8", "sync.lora=adapters"]


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the checkout


def _hand_computed(rank: int, dtype_bytes: int = 2, mlp: bool = True) -> int:
    """Qwen3-8B (configs/recipes/qwen3_8b/hf/config.json): hidden 4096, 32 query heads and 8 KV heads of 128,
    MLP 12288, 36 layers; PEFT sends r x (in + out) per projection."""
    hidden, query, kv, ffn, layers = 4096, 32 * 128, 8 * 128, 12288, 36
    attention = (hidden + query) + 2 * (hidden + kv) + (query + hidden)  # q, k, v, o
    mlp_part = 2 * (hidden + ffn) + (ffn + hidden) if mlp else 0  # gate, up, down
    return layers * rank * (attention + mlp_part) * dtype_bytes


def test_an_adapters_sync_streams_the_adapter_bytes():
    merged = make_plan(load_config(QWEN3_8B, ["actor.lora.rank=8"], check=False))
    plan = make_plan(load_config(QWEN3_8B, ADAPTERS, check=False))
    assert plan.refit.bytes_per_sync == _hand_computed(8) == 43_646_976
    assert plan.refit.engine_gpu_receives == plan.refit.bytes_per_sync and plan.refit.adapters_only
    assert merged.refit.bytes_per_sync == 2 * merged.parameters and not merged.refit.adapters_only
    assert plan.refit.seconds_overlapped < merged.refit.seconds_overlapped / 100
    attention_only = make_plan(load_config(QWEN3_8B, [*ADAPTERS, "actor.lora.target_modules=[linear_qkv,linear_proj]",
                                                      "actor.dtype=fp32"], check=False))
    assert attention_only.refit.bytes_per_sync == _hand_computed(8, dtype_bytes=4, mlp=False)


def test_the_report_says_the_sync_sends_adapters_only(capsys):
    assert main(["plan", QWEN3_8B, *ADAPTERS]) == 0
    refit = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("refit"))
    assert refit == ("refit      43.6 MB per sync to every engine GPU, adapters only (sync.lora=adapters), "
                     "transport shared_memory (auto)")

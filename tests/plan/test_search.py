"""`rlmega plan --search`: every layout it reports fits and every one it rejects does not, by the same planner;
the best one's overrides select it; nothing that fits is an error naming what to change; DeepSeek-V3 on 256 H100
finds a layout in minutes."""

import json
from pathlib import Path

import pytest

from rlmega.cli.main import main
from rlmega.config import load_config
from rlmega.plan import make_plan
from rlmega.plan.search import _CachedMeasure, apply, search

ROOT = Path(__file__).resolve().parents[2]
BASE = "configs/recipes/qwen3_8b/grpo.yaml"
TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=512, intermediate_size=1536,
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
            max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
            torch_dtype="bfloat16")


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _tiny_job(tmp_path, memory_gib: float) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return [f"model.path={tmp_path}", "layout.world_size=4", "layout.tp=1", "plan.gpu=small", "plan.gpus_per_node=4",
            f"plan.gpu_memory_gib={memory_gib}", "plan.nvlink_gb_per_s=450", "plan.reserved_gib=0.05",
            "plan.min_headroom_gib=0.05", "plan.engine_workspace_gib=0.02", "rollout.num_engines=2",
            "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.5", "data.max_prompt_length=512",
            "rollout.max_new_tokens=1536", "trainer.prompts_per_step=8", "rollout.n=4",
            "actor.batching.max_tokens_per_microbatch=2048", "sync.bucket_bytes=1048576"]


def test_every_layout_reported_fits_and_every_rejected_one_does_not(tmp_path):
    config = load_config(BASE, _tiny_job(tmp_path, 0.55), check=False)
    result = search(config, "tiny", top=2, max_plans=6)
    assert result.fitting and result.bounded, "the job should leave some layouts out and fit others"
    assert [o.total for o in result.fitting] == sorted(o.total for o in result.fitting)
    measure = _CachedMeasure()
    for outcome in result.fitting:  # the overrides select what was planned, and it fits
        plan = make_plan(load_config(BASE, _tiny_job(tmp_path, 0.55) + outcome.overrides, check=False), measure=measure)
        assert not plan.shortfalls and plan.layout == outcome.plan.layout
    for outcome in result.rejected:
        assert outcome.reason
    # Every one the memory bound dropped without a build does not fit either, by the planner.
    for candidate in result.bounded:
        plan = make_plan(apply(config, candidate), measure=measure)
        assert plan.shortfalls, candidate.describe()


def test_the_command_prints_the_ranking_the_choice_and_the_best_plan(tmp_path, capsys):
    assert main(["plan", BASE, *_tiny_job(tmp_path, 0.55), "--search", "--top", "1", "--max-plans", "4"]) == 0
    out = capsys.readouterr().out
    assert "fit, cheapest first" in out and "\nbest       " in out and "lowest predicted step time" in out
    assert "\noverrides  layout.tp=" in out and out.rstrip().endswith("GiB free on every GPU in every phase")


def test_a_job_nothing_fits_says_what_to_change(tmp_path, capsys):
    assert main(["plan", BASE, *_tiny_job(tmp_path, 0.1), "--search", "--max-plans", "2"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlmega plan: ") and "no layout the search planned fits" in line


def test_deepseek_v3_on_256_h100_finds_a_layout_that_fits():
    recipe = "configs/recipes/deepseek_v3_671b/grpo.yaml"
    result = search(load_config(recipe, check=False), recipe, top=1, max_plans=4)
    assert result.best is not None and not result.best.plan.shortfalls
    assert result.best.plan.world_size == 256  # its time is benchmarks/refit_plan.py's to measure, not a test's

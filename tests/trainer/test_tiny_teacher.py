"""``tiny_teacher: true`` builds the quickstart's teacher at set-up into run_dir/assets/teacher, once: a 4-layer Llama
of the tiny policy's width with its tokenizer, trained until its greedy answers solve the validation prompts."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmega.config import load_config
from rlmega.trainer.assets import TINY_MODEL
from rlmega.trainer.run_assets import validate_with_assets
from rlmega.trainer.tiny_teacher import greedy_accuracy

OVERRIDES = ["tiny_teacher=true", "teacher.enable=true", "teacher.path=${run_dir}/assets/teacher",
             "algorithm.distill.coef=1"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    config = load_config("tiny_cpu", [f"run_dir={run_dir}", *OVERRIDES], check=False)
    validate_with_assets(config)
    return run_dir, config


def test_the_tiny_teacher_solves_the_task(built, capsys):
    run_dir, config = built
    teacher = run_dir / "assets" / "teacher"
    settings = json.loads((teacher / "config.json").read_text())
    assert settings["num_hidden_layers"] == 4 and settings["hidden_size"] == TINY_MODEL["hidden_size"]
    policy = AutoTokenizer.from_pretrained(run_dir / "assets" / "model")
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    assert tokenizer.get_vocab() == policy.get_vocab() and tokenizer.eos_token == policy.eos_token
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    assert greedy_accuracy(model, tokenizer, config.val_data.files) > 0.9
    assert not list((run_dir / "assets").glob("*.tmp*"))
    # Built once per directory: a second set-up finds it and trains nothing.
    before = (teacher / "model.safetensors").stat().st_mtime_ns
    validate_with_assets(load_config("tiny_cpu", [f"run_dir={run_dir}", *OVERRIDES], check=False))
    assert (teacher / "model.safetensors").stat().st_mtime_ns == before
    assert "trained the tiny teacher" not in capsys.readouterr().out

"""LoRA settings that cannot work are refused in one line naming the field; a LoRA actor builds no reference model."""

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError


def _error(tmp_path, *overrides) -> str:
    with pytest.raises(UserError) as error:
        load_config("tiny_cpu", [f"run_dir={tmp_path}", *overrides])
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("override, expected", [
    ("actor.lora.rank=-1", "actor.lora.rank must be >= 0"),
    ("actor.lora.target_modules=[q_proj]", "actor.lora.target_modules must be a non-empty list of linear_qkv"),
    ("actor.lora.target_modules=[experts.linear_qkv]", "experts.linear_fc1, experts.linear_fc2"),
    ("actor.lora.dropout=1.0", "actor.lora.dropout must be in [0, 1)"),
    ("actor.lora.dropout=-0.1", "actor.lora.dropout must be in [0, 1)"),
    ("ref.lora.rank=8", "ref.lora: LoRA adapters are for the actor; set ref.lora.rank=0"),
    ("critic.lora.rank=8", "critic.lora: LoRA adapters are for the actor"),
])
def test_bad_lora_settings_are_refused(tmp_path, override, expected):
    assert expected in _error(tmp_path, override)


def test_expert_targets_and_dropout_are_accepted(tmp_path):
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "actor.lora.rank=8", "actor.lora.dropout=0.05",
                                      "actor.lora.target_modules=[linear_qkv,experts.linear_fc1,experts.linear_fc2]"],
                         check=False)  # the tiny model's checkpoint is made by the run
    config.actor.lora.check("actor.lora")
    assert config.actor.lora.dropout == 0.05
    assert list(config.actor.lora.target_modules) == ["linear_qkv", "experts.linear_fc1", "experts.linear_fc2"]


def test_lora_actor_is_its_own_reference(tmp_path):
    full = load_config("tiny_cpu", [f"run_dir={tmp_path}"], check=False)
    lora = load_config("tiny_cpu", [f"run_dir={tmp_path}", "actor.lora.rank=8"], check=False)
    assert full.needs_reference and full.builds_reference_model
    assert lora.needs_reference and not lora.builds_reference_model


def test_the_planner_counts_the_adapters_training_state_and_no_reference(monkeypatch):
    from pathlib import Path

    from rlmega.plan import make_plan

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the recipe names its config.json relative to the checkout
    recipe = "configs/recipes/qwen3_8b/grpo.yaml"
    full = make_plan(load_config(recipe, check=False))
    lora = make_plan(load_config(recipe, ["actor.lora.rank=8"], check=False))
    [f], [a] = full.positions, lora.positions
    assert "ref" in f.roles and "ref" not in a.roles
    actor_full, actor_lora = f.roles["actor"], a.roles["actor"]
    assert actor_lora.params >= actor_full.params  # the frozen base and the adapters
    assert actor_lora.grads < actor_full.grads / 100 and actor_lora.optimizer_gpu < actor_full.optimizer_gpu / 100
    assert a.phases["logprobs"] < f.phases["logprobs"]  # no reference weights resident


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from rlmega.trainer.assets import prepare_tiny_assets

    run_dir = tmp_path_factory.mktemp("run")
    prepare_tiny_assets(run_dir / "assets", num_train=16, num_val=4)
    return run_dir


def test_expert_adapters_on_a_dense_model_are_refused(run_dir):
    message = _error(run_dir, "actor.lora.rank=8", "actor.lora.target_modules=[linear_qkv,experts.linear_fc1]")
    assert message == ("actor.lora.target_modules: experts.linear_fc1 adapt a MoE model's experts; this model has "
                       "none: drop them")


def test_expert_dropout_across_expert_tp_ranks_is_refused(run_dir, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))
    from hf_models import save_tiny_model

    save_tiny_model("qwen3-moe", tmp_path / "moe")
    overrides = ["actor.lora.rank=8", "actor.lora.dropout=0.1", f"model.path={tmp_path / 'moe'}",
                 "actor.lora.target_modules=[experts.linear_fc1]", "layout.tp=2"]
    assert _error(run_dir, *overrides).startswith("actor.lora.dropout: dropout on experts.linear_fc1 needs layout.etp=1")

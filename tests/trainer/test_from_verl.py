"""Crossing over from verl: verl configs translate into rlmega overrides that load, refusals say why."""

from pathlib import Path

import pytest
import yaml

from rlmega.algos import GSPOLossConfig, PPOLossConfig
from rlmega.config import load_config
from rlmega.config.verl import (
    VERL_SETTINGS,
    VerlTranslationError,
    _defaults_tree,
    hydra_value,
    markdown_table,
    rlmega_field_exists,
    translate_verl,
    translate_verl_config,
)
from rlmega.config.verl_report import report_table

DOC = Path(__file__).resolve().parents[2] / "rlmega" / "config" / "VERL.md"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# verl's GRPO example on Megatron (examples/grpo_trainer/run_qwen2-7b_math_megatron.sh, on top of
# ppo_megatron_trainer.yaml), written as a config file.
GRPO_MEGATRON = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {
        "train_files": ["/data/gsm8k/train.parquet", "/data/math/train.parquet"],
        "val_files": ["/data/gsm8k/test.parquet", "/data/math/test.parquet"],
        "return_raw_chat": True, "train_batch_size": 1024, "max_prompt_length": 1024, "max_response_length": 1024,
        "filter_overlong_prompts": True, "truncation": "error",
    },
    "actor_rollout_ref": {
        "model": {"path": "Qwen/Qwen2-7B-Instruct", "use_fused_kernels": True},
        "actor": {
            "strategy": "megatron",
            "optim": {"lr": 1e-6},
            "ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 4,
            "megatron": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
            "use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "entropy_coeff": 0,
        },
        "rollout": {"log_prob_micro_batch_size_per_gpu": 4, "tensor_model_parallel_size": 2, "name": "vllm",
                    "mode": "async", "n": 5, "gpu_memory_utilization": 0.6},
        "ref": {"log_prob_micro_batch_size_per_gpu": 4,
                "megatron": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2}},
    },
    "trainer": {"critic_warmup": 0, "logger": ["console", "wandb"], "project_name": "verl_grpo_example_gsm8k_math",
                "experiment_name": "qwen2_7b_megatron", "n_gpus_per_node": 8, "nnodes": 1, "save_freq": 20,
                "test_freq": 5, "total_epochs": 15},
}


def write(tmp_path, config: dict, name: str = "verl.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def load(tmp_path, overrides: list[str]):
    return load_config("tiny_cpu", overrides + [f"run_dir={tmp_path}"], check=False)


def test_grpo_example_translates_and_loads(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON))
    config = load(tmp_path, overrides)
    assert config.rollout.n == 5 and config.rollout.backend == "vllm" and config.rollout.max_new_tokens == 1024
    assert config.rollout.tensor_parallel_size == 2 and config.rollout.gpu_memory_utilization == 0.6
    assert config.trainer.total_epochs == 15 and config.trainer.critic_warmup == 0
    assert config.trainer.prompts_per_step == 1024 and config.actor.ppo_mini_batches == 1024 // 256
    assert config.actor.optimizer.lr == 1e-6 and config.actor.optimizer.lr_warmup_steps == 0
    loss = config.actor.policy_loss
    assert (loss.name, loss.kl_loss_coef, loss.kl_estimator, loss.entropy_coeff) == ("ppo", 0.001, "low_var_kl", 0.0)
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.2, 0.2, 3.0)  # verl's vanilla dual-clips
    assert loss.loss_config() == PPOLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert config.algorithm.adv_estimator == "grpo" and config.algorithm.kl_in_reward_coef == 0.0
    assert (config.layout.tp, config.layout.pp, config.layout.world_size) == (2, 2, 8)
    assert config.data.files == GRPO_MEGATRON["data"]["train_files"]
    assert config.val_data.files == GRPO_MEGATRON["data"]["val_files"]
    assert config.data.max_prompt_length == config.val_data.max_prompt_length == 1024
    assert config.data.filter_overlong_prompts and config.data.truncation == "error"
    assert config.model.path == "Qwen/Qwen2-7B-Instruct"
    assert config.metrics.backends == ["console", "wandb"]
    assert (config.metrics.project, config.metrics.experiment_name) == ("verl_grpo_example_gsm8k_math",
                                                                        "qwen2_7b_megatron")
    assert (config.trainer.save_every, config.trainer.val_every) == (20, 5)
    assert config.rollout.val_temperature == 0.0 and config.rollout.top_k is None
    assert not any(line.startswith("critic.") for line in overrides)  # GRPO trains no critic


def test_verl_defaults_translate_and_load(tmp_path):
    defaults = _defaults_tree()
    defaults["actor_rollout_ref"]["rollout"]["name"] = "vllm"
    defaults["actor_rollout_ref"]["actor"]["strategy"] = defaults["critic"]["strategy"] = "megatron"
    config = load(tmp_path, translate_verl_config(write(tmp_path, defaults)))
    assert config.algorithm.adv_estimator == "gae" and config.rollout.n == 1  # verl's default is PPO with a critic
    assert config.critic.optimizer.lr == 1e-5 and config.critic.ppo_mini_batches == 4


def test_command_line_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, GRPO_MEGATRON)
    overrides = translate_verl_config(path, ["actor_rollout_ref.rollout.n=8", "++actor_rollout_ref.actor.optim.lr=2e-6",
                                             "+actor_rollout_ref.rollout.temperature=0.7", "~data.val_files"])
    assert "rollout.n=8" in overrides and "actor.optimizer.lr=2e-06" in overrides
    assert "rollout.temperature=0.7" in overrides
    assert not any(line.startswith("val_data.files=") for line in overrides)
    config = load(tmp_path, overrides)
    assert config.rollout.n == 8 and config.actor.optimizer.lr == 2e-6


@pytest.mark.parametrize("override, reason", [
    ("critic.model.lora_rank=8", "LoRA adapters on the actor only"),
    ("reward_model.enable=true", "model-based rewards are not in rlmega"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn rollouts"),
    ("algorithm.adv_estimator=opo", "OPO"),
    ("actor_rollout_ref.rollout.name=trtllm", "rlmega's engines are hf, vllm and sglang"),
    ("trainer.logger=[console,swanlab]", "swanlab"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01", "config.json as it is"),
])
def test_a_refused_key_names_the_key_and_the_reason_on_one_line(tmp_path, override, reason):
    with pytest.raises(VerlTranslationError) as error:
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), [override])
    message = str(error.value)
    key = override.lstrip("+").partition("=")[0]
    assert message.startswith(f"verl {key}=") and reason in message and "\n" not in message


def test_validation_samples_with_its_own_parameters(tmp_path):
    path = write(tmp_path, GRPO_MEGATRON)
    sampled = ["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
               "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=20"]
    rollout = load(tmp_path, translate_verl_config(path, sampled + [
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.7", "actor_rollout_ref.rollout.val_kwargs.n=4"])).rollout
    assert (rollout.val_temperature, rollout.val_top_p, rollout.val_top_k, rollout.val_n) == (0.6, 0.7, 0, 4)
    assert (rollout.top_p, rollout.top_k) == (0.9, 20)  # verl's validation top_k -1 is none at all: rlmega's 0
    rollout = load(tmp_path, translate_verl_config(path, sampled)).rollout
    assert (rollout.val_top_p, rollout.val_top_k) == (1.0, 0)  # verl's defaults, not training's
    same = ["actor_rollout_ref.rollout.val_kwargs.top_p=0.9", "actor_rollout_ref.rollout.val_kwargs.top_k=20"]
    rollout = load(tmp_path, translate_verl_config(path, sampled + same)).rollout
    assert (rollout.val_top_p, rollout.val_top_k) == (None, None)  # the training values
    greedy = translate_verl(path, ["actor_rollout_ref.rollout.val_kwargs.top_p=0.7"])
    assert "rollout.val_temperature=0.0" in greedy.overrides and not any("val_top_p" in o for o in greedy.overrides)
    rows = {row.key: row for row in greedy.changed}
    assert rows["actor_rollout_ref.rollout.val_kwargs.top_p"].rlmega == "not used"  # greedy validation filters nothing


def test_a_refused_key_at_verl_default_or_null_is_accepted(tmp_path):
    translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "actor_rollout_ref.model.lora_rank=0", "data.custom_cls.path=null", "trainer.default_hdfs_dir=null",
        "actor_rollout_ref.actor.optim.optimizer=AdamW", "+actor_rollout_ref.model.override_config.model_config={}",
        "actor_rollout_ref.actor.profiler.enable=false", "algorithm.rollout_correction=null"])


def test_an_unknown_key_suggests_the_nearest_known_one(tmp_path):
    with pytest.raises(VerlTranslationError, match=r"actor_rollout_ref\.rollout\.temprature=0\.7: .*nearest known key is "
                                                   r"actor_rollout_ref\.rollout\.temperature$"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["+actor_rollout_ref.rollout.temprature=0.7"])


def test_train_batch_size_must_be_a_multiple_of_the_mini_batch_size(tmp_path):
    with pytest.raises(VerlTranslationError, match="data.train_batch_size=1000 is not a multiple of "
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=256"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["data.train_batch_size=1000"])


def test_kl_in_the_reward_and_its_estimator(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.005", "algorithm.kl_penalty=k1"])
    config = load(tmp_path, overrides)
    assert config.actor.policy_loss.kl_loss_coef == 0.0 and config.algorithm.kl_in_reward_coef == 0.005
    assert config.actor.policy_loss.kl_estimator == "k1"


def test_the_two_kl_estimators_must_agree_when_both_kl_terms_are_on(tmp_path):
    with pytest.raises(VerlTranslationError, match="kl_loss_type=low_var_kl and algorithm.kl_penalty=kl differ"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["algorithm.use_kl_in_reward=true"])


def test_two_keys_that_give_one_field_different_values_are_refused(tmp_path):
    with pytest.raises(VerlTranslationError, match=r"ref\.megatron\.tensor_model_parallel_size=4: .*actor\.megatron\."
                                                   r"tensor_model_parallel_size=2 gives rlmega's layout\.tp 2, "
                                                   r"this gives 4"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4"])


def test_dapo_settings_cross_over(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "+reward_model.overlong_buffer.enable=true",
        "+reward_model.overlong_buffer.len=128", "+reward_model.overlong_buffer.penalty_factor=1.0",
        "reward_model.reward_manager=dapo", "+algorithm.filter_groups.enable=true",
        "+algorithm.filter_groups.metric=seq_reward", "+algorithm.filter_groups.max_num_gen_batches=10",
        "+data.gen_batch_size=1536"])
    config = load(tmp_path, overrides)
    assert config.actor.policy_loss.clip_ratio_high == 0.28 and config.actor.policy_loss.kl_loss_coef == 0.0
    assert (config.algorithm.overlong_buffer_length, config.algorithm.overlong_penalty_factor) == (128, 1.0)
    assert config.algorithm.dynamic_sampling and config.algorithm.max_generation_rounds == 15  # 10 * 1536 / 1024


@pytest.mark.parametrize("metric, rlmega", [("acc", "acc"), ("score", "score"), ("seq_reward", "shaped_score"),
                                            ("seq_final_reward", "shaped_score"), ("pred_len", "pred_len")])
def test_dapo_filters_on_the_metric_verl_names(tmp_path, metric, rlmega):
    config = load(tmp_path, translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "+algorithm.filter_groups.enable=true", f"+algorithm.filter_groups.metric={metric}",
        "+algorithm.filter_groups.max_num_gen_batches=10"]))
    assert config.algorithm.dynamic_sampling and config.algorithm.dynamic_sampling_metric == rlmega


def test_dapo_filtering_on_the_reward_after_kl_is_refused(tmp_path):
    with pytest.raises(VerlTranslationError, match="filter_groups.metric=seq_final_reward: rlmega filters groups "
                                                   "before the reference's KL is known"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
            "+algorithm.filter_groups.enable=true", "+algorithm.filter_groups.metric=seq_final_reward",
            "+algorithm.filter_groups.max_num_gen_batches=10", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=low_var_kl"])


def test_dropout_zero_is_what_rlmega_does(tmp_path):
    path = write(tmp_path, GRPO_MEGATRON)
    zero = [f"+actor_rollout_ref.model.override_config.{name}=0." for name in ("attention_dropout", "embd_pdrop",
                                                                                "resid_pdrop")]
    translation = translate_verl(path, zero + [
        "+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=0"])
    assert not translation.refused and not any("dropout" in row.key or "pdrop" in row.key for row in translation.changed)
    with pytest.raises(VerlTranslationError, match=r"^verl actor_rollout_ref\.model\.override_config\.resid_pdrop=0\.1: "
                                                   "rlmega trains without dropout"):
        translate_verl_config(path, ["+actor_rollout_ref.model.override_config.resid_pdrop=0.1"])


def test_every_refused_setting_is_reported_at_once(tmp_path):
    overrides = ["+actor_rollout_ref.model.override_config.attention_dropout=0.1", "trainer.device=npu",
                 "critic.model.lora_rank=8", "+actor_rollout_ref.rollout.temprature=0.7",
                 "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.n=8"]
    translation = translate_verl(write(tmp_path, GRPO_MEGATRON), overrides)
    assert sorted(row.key for row in translation.refused) == sorted([
        "actor_rollout_ref.model.override_config.attention_dropout", "trainer.device", "critic.model.lora_rank",
        "actor_rollout_ref.rollout.temprature", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"])
    assert all(row.rlmega == "refused" and row.why for row in translation.refused)
    with pytest.raises(VerlTranslationError) as error:
        translation.check()
    message = str(error.value)
    assert message.startswith("5 verl settings cannot cross over to rlmega: ") and "\n" not in message
    assert all(f"{row.key}={row.value} ({row.why})" in message for row in translation.refused)
    table = report_table(translation.refused).splitlines()
    assert table[0] == "| verl key | value | rlmega | why |" and len(table) == 2 + 5
    assert "| `trainer.device` | `npu` | refused | rlmega trains on CUDA GPUs (or on CPU) |" in table


def test_gspo_averages_per_sequence_and_takes_only_its_parameters(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=4e-4"])
    loss = load(tmp_path, overrides).actor.policy_loss
    assert (loss.name, loss.loss_agg_mode, loss.clip_ratio_low, loss.clip_ratio_high) == (
        "gspo", "seq-mean-token-mean", 3e-4, 4e-4)
    assert loss.clip_ratio_c is None and loss.loss_config() == GSPOLossConfig(
        loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)


def test_lora_on_the_actor_crosses_over_with_megatron_names(tmp_path):
    path = write(tmp_path, GRPO_MEGATRON)
    config = load(tmp_path, translate_verl_config(path, [
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"]))
    assert (config.actor.lora.rank, config.actor.lora.alpha) == (8, 32)
    assert config.actor.lora.target_modules == ["linear_qkv", "linear_proj"]
    with pytest.raises(VerlTranslationError, match=r"target_modules \['lm_head'\]: rlmega adapts linear_qkv"):
        translate_verl_config(path, ["actor_rollout_ref.model.lora_rank=8",
                                     "actor_rollout_ref.model.target_modules=[q_proj,lm_head]"])
    config = load(tmp_path, translate_verl_config(path, ["actor_rollout_ref.model.lora.rank=4",
                                                         "actor_rollout_ref.model.lora.dropout=0.1"]))
    assert config.actor.lora.rank == 4 and config.actor.lora.target_modules == [
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert config.actor.lora.dropout == 0.1


def test_fp8_rollout_crosses_over_and_other_quantizations_are_refused(tmp_path):
    path = write(tmp_path, GRPO_MEGATRON)
    config = load(tmp_path, translate_verl_config(path, ["actor_rollout_ref.rollout.quantization=fp8"]))
    assert config.rollout.weight_dtype == "fp8"
    with pytest.raises(VerlTranslationError, match="rollout.quantization=int8: rlmega's engines serve fp8"):
        translate_verl_config(path, ["actor_rollout_ref.rollout.quantization=int8"])


def test_estimator_names_cross_over(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["algorithm.adv_estimator=rloo_vectorized",
                                                                        "algorithm.norm_adv_by_std_in_grpo=false"])
    config = load(tmp_path, overrides)
    assert config.algorithm.adv_estimator == "rloo" and not config.algorithm.norm_adv_by_std


def test_warm_up_steps_count_optimizer_steps(tmp_path):
    overrides = translate_verl_config(write(tmp_path, GRPO_MEGATRON), [
        "actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.optim.lr_decay_style=cosine", "trainer.total_training_steps=100"])
    optimizer = load(tmp_path, overrides).actor.optimizer
    per_rl_step = 2 * (1024 // 256)  # verl steps its schedule once per RL step, rlmega once per optimizer step
    assert (optimizer.lr_warmup_steps, optimizer.lr_decay_steps, optimizer.lr_schedule) == (
        10 * per_rl_step, 100 * per_rl_step, "cosine")


def test_a_warm_up_ratio_needs_the_total_steps(tmp_path):
    with pytest.raises(VerlTranslationError, match="needs trainer.total_training_steps"):
        translate_verl_config(write(tmp_path, GRPO_MEGATRON), ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])


def test_a_hydra_defaults_list_is_refused_with_the_way_out(tmp_path):
    config = {"defaults": ["ppo_megatron_trainer", "_self_"], **GRPO_MEGATRON}
    with pytest.raises(VerlTranslationError, match=r"defaults list \(ppo_megatron_trainer\).*--cfg job"):
        translate_verl_config(write(tmp_path, config))
    translate_verl_config(write(tmp_path, {"defaults": ["_self_"], **GRPO_MEGATRON}))


@pytest.mark.parametrize("override, field, value", [
    ("trainer.total_epochs=15", "trainer.total_epochs", 15),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "rollout.gpu_memory_utilization", 0.6),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=4", "rollout.tensor_parallel_size", 4),
    ("trainer.max_actor_ckpt_to_keep=3", "trainer.max_checkpoints_to_keep", 3),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
     "actor.recompute_granularity", "full"),
])
def test_a_field_rlmega_lacks_is_refused_until_the_schema_has_it(tmp_path, override, field, value):
    path = write(tmp_path, GRPO_MEGATRON)
    if not rlmega_field_exists(field):
        with pytest.raises(VerlTranslationError, match=f"maps to rlmega's {field}, which this rlmega's config schema "
                                                       "does not have yet"):
            translate_verl_config(path, [override])
        return
    config = load(tmp_path, translate_verl_config(path, [override]))
    node = config
    for part in field.split("."):
        node = getattr(node, part)
    assert node == value


def test_every_target_is_a_field():
    targets = {target for setting in VERL_SETTINGS.values() for target in setting.targets}
    missing = {target for target in targets if not rlmega_field_exists(target)}
    assert not missing, f"the table maps to fields rlmega lacks: {sorted(missing)}"


def test_the_document_holds_the_table():
    doc = DOC.read_text()
    assert all(f"| `{key}` |" in doc for key in VERL_SETTINGS)
    assert markdown_table() in doc, ("VERL.md's table is out of date: regenerate it with "
                                     "python -c 'from rlmega.config.verl import markdown_table; print(markdown_table())'")


@pytest.mark.parametrize("value", [None, True, 0, -1, 1e-06, 0.2, "vllm", "token-mean", "/data/a b.parquet",
                                   "path/f.py:compute_score", "null", "1e5", "it's", ["console", "wandb"], {"a": 1},
                                   {"enable_thinking": False}, []])
def test_hydra_values_read_back_as_the_same_value(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert OverridesParser.create().parse_override(f"key={hydra_value(value)}").value() == value


def test_the_quickstart_written_as_a_verl_config_trains_the_same_run(tmp_path):
    """configs/verl/tiny_cpu_grpo.yaml on top of tiny_cpu gives the quickstart's run, except where verl's
    meaning differs (its PPO loss always dual-clips) and the loggers it names."""
    import dataclasses

    verl = CONFIGS / "verl" / "tiny_cpu_grpo.yaml"
    translated = load(tmp_path, translate_verl_config(verl))
    native = load(tmp_path, [])
    assert translated.actor.policy_loss.clip_ratio_c == 3.0 and native.actor.policy_loss.clip_ratio_c is None
    translated.actor.policy_loss.clip_ratio_c = None
    loss = translated.actor.policy_loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.2, 0.2)  # verl spells out PPO's default
    loss.clip_ratio_low = loss.clip_ratio_high = None
    translated.metrics.backends = native.metrics.backends
    for section in ("algorithm", "rollout", "actor", "ref", "layout", "data", "trainer", "sync"):
        assert dataclasses.asdict(getattr(translated, section)) == dataclasses.asdict(getattr(native, section)), section

"""verl's published DAPO recipe for Qwen2.5-32B crosses over whole: its override list, as the shell hands it to
verl, translates in one run to an equivalent rlmega config, with a report of every setting rlmega takes
differently; the one setting rlmega cannot take (an Ascend NPU) is refused alone."""

from pathlib import Path

import pytest

from rlmega.cli.main import main
from rlmega.config import load_config
from rlmega.config.verl import VerlTranslationError, translate_verl, translate_verl_config

# verl's recipe/dapo/run_dapo_qwen2.5_32b_npu.sh (volcengine/verl 7deb67ca177a38b060bca007198aecb3fa4431dd,
# December 2025): the arguments its `ray job submit ... -- python3 -m recipe.dapo.main_dapo` passes, with the
# shell's variables expanded (HOME=/home/user).
DAPO_QWEN25_32B_NPU = [
    "data.train_files=/home/user/verl/data/dapo-math-17k.parquet",
    "data.val_files=/home/user/verl/data/aime-2024.parquet",
    "data.prompt_key=prompt",
    "data.truncation=left",
    "data.max_prompt_length=2048",
    "data.max_response_length=20480",
    "data.gen_batch_size=384",
    "data.train_batch_size=128",
    "actor_rollout_ref.rollout.n=16",
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.metric=acc",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.ref.use_torch_compile=False",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2816",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2816",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2816",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.path=/home/user/verl/models/Qwen2.5-32B",
    "+actor_rollout_ref.model.override_config.attention_dropout=0.",
    "+actor_rollout_ref.model.override_config.embd_pdrop=0.",
    "+actor_rollout_ref.model.override_config.resid_pdrop=0.",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
    "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.grad_clip=1.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.90",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=22528",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=8",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
    "reward_model.reward_manager=dapo",
    "reward_model.overlong_buffer.enable=True",
    "reward_model.overlong_buffer.len=4096",
    "reward_model.overlong_buffer.penalty_factor=1.0",
    "trainer.logger=['console','wandb']",
    "trainer.project_name=DAPO-Qwen2.5-32B",
    "trainer.experiment_name=Qwen2.5-32B-npu-32rank-gbs128",
    "trainer.n_gpus_per_node=16",
    "trainer.nnodes=2",
    "trainer.val_before_train=True",
    "trainer.test_freq=5",
    "trainer.save_freq=20",
    "trainer.total_epochs=1",
    "trainer.default_local_dir=/home/user/verl/ckpts/DAPO-Qwen2.5-32B/Qwen2.5-32B-npu-32rank-gbs128",
    "trainer.device=npu",
    "trainer.resume_mode=auto",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True"
]
NPU = "trainer.device=npu"

# verl's recipe/dapo/config/dapo_trainer.yaml, which main_dapo composes on top of verl's ppo_trainer.yaml (whose
# defaults the table holds), without its Hydra defaults list and search path.
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "verl" / "dapo_trainer.yaml"


@pytest.fixture
def recipe():
    return RECIPE


def published_without_npu() -> list[str]:
    return [override for override in DAPO_QWEN25_32B_NPU if override != NPU]


def test_the_script_as_published_refuses_only_the_npu(recipe):
    translation = translate_verl(recipe, DAPO_QWEN25_32B_NPU)
    assert [(row.key, row.value, row.rlmega) for row in translation.refused] == [("trainer.device", "npu", "refused")]
    with pytest.raises(VerlTranslationError, match=r"^verl trainer\.device=npu: rlmega trains on CUDA GPUs"):
        translate_verl_config(recipe, DAPO_QWEN25_32B_NPU)


def test_the_script_lands_on_the_equivalent_rlmega_config(recipe, tmp_path):
    overrides = translate_verl_config(recipe, published_without_npu())
    config = load_config("tiny_cpu", overrides, check=False)
    assert config.run_dir == "/home/user/verl/ckpts/DAPO-Qwen2.5-32B/Qwen2.5-32B-npu-32rank-gbs128"
    assert config.model.path == "/home/user/verl/models/Qwen2.5-32B"
    assert config.data.files == ["/home/user/verl/data/dapo-math-17k.parquet"]
    assert config.val_data.files == ["/home/user/verl/data/aime-2024.parquet"]
    for data in (config.data, config.val_data):
        assert (data.prompt_key, data.truncation, data.max_prompt_length) == ("prompt", "left", 2048)
    algorithm = config.algorithm
    assert (algorithm.adv_estimator, algorithm.norm_adv_by_std, algorithm.kl_in_reward_coef) == ("grpo", True, 0.0)
    # DAPO: dynamic sampling on accuracy, 10 generation batches of 384 prompts = 30 rounds of 128
    assert (algorithm.dynamic_sampling, algorithm.dynamic_sampling_metric) == (True, "acc")
    assert algorithm.max_generation_rounds == 30
    assert (algorithm.overlong_buffer_length, algorithm.overlong_penalty_factor) == (4096, 1.0)
    loss = config.actor.policy_loss
    assert (loss.name, loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == ("ppo", 0.2, 0.28, 10.0)
    assert (loss.loss_agg_mode, loss.kl_loss_coef, loss.entropy_coeff) == ("token-mean", 0.0, 0)
    assert not config.needs_reference
    actor = config.actor
    assert (config.trainer.prompts_per_step, config.rollout.n, actor.ppo_mini_batches, actor.ppo_epochs) == (
        128, 16, 4, 1)
    optimizer = actor.optimizer
    assert (optimizer.lr, optimizer.weight_decay, optimizer.clip_grad, optimizer.lr_schedule) == (
        1e-6, 0.1, 1.0, "constant")
    assert optimizer.lr_warmup_steps == 10 * 4  # verl's 10 RL steps, 4 optimizer steps each
    assert actor.offload and config.ref.offload  # FSDP param and optimizer offload
    assert actor.recompute_granularity == "full"  # enable_gradient_checkpointing
    assert actor.batching.max_tokens_per_microbatch == config.ref.batching.max_tokens_per_microbatch == 2816
    assert (config.layout.world_size, config.layout.cp) == (32, 8)  # 2 nodes x 16, Ulysses 8
    rollout = config.rollout
    assert (rollout.backend, rollout.tensor_parallel_size, rollout.gpu_memory_utilization) == ("vllm", 4, 0.9)
    assert (rollout.max_new_tokens, rollout.max_num_batched_tokens) == (20480, 22528)
    assert (rollout.temperature, rollout.top_p, rollout.top_k) == (1.0, 1.0, None)
    assert (rollout.val_temperature, rollout.val_top_p, rollout.val_top_k, rollout.val_n) == (1.0, 0.7, None, 1)
    trainer = config.trainer
    assert (trainer.total_epochs, trainer.val_every, trainer.save_every, trainer.val_before_train) == (1, 5, 20, True)
    assert config.resume == "auto"
    assert config.metrics.backends == ["console", "wandb"]
    assert (config.metrics.project, config.metrics.experiment_name) == (
        "DAPO-Qwen2.5-32B", "Qwen2.5-32B-npu-32rank-gbs128")


def test_the_report_states_what_rlmega_does_instead(recipe):
    translation = translate_verl(recipe, published_without_npu())
    assert not translation.refused
    rows = {row.key: row for row in translation.changed}
    for flag in ("param_offload", "optimizer_offload"):  # the offload mapping, stated
        row = rows[f"actor_rollout_ref.actor.fsdp_config.{flag}"]
        assert row.rlmega == "actor.offload=true" and "parameters, gradients and optimizer state together" in row.why
    assert rows["actor_rollout_ref.actor.optim.lr_warmup_steps"].rlmega == "actor.optimizer.lr_warmup_steps=40"
    assert rows["data.gen_batch_size"].rlmega == "algorithm.max_generation_rounds=30"
    assert rows["actor_rollout_ref.actor.fsdp_config.forward_prefetch"].rlmega == "not used"
    assert rows["actor_rollout_ref.actor.use_torch_compile"].rlmega == "not used"
    assert rows["trainer.nnodes"].rlmega == "layout.world_size=32"
    # taken as they are: no row
    for key in ("algorithm.filter_groups.metric", "actor_rollout_ref.rollout.val_kwargs.top_p",
                "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.model.override_config.attention_dropout",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "reward_model.reward_manager"):
        assert key not in rows, key
    assert all(row.why for row in translation.changed)


def test_the_command_line_shows_the_report_and_refuses_everything_at_once(recipe, tmp_path, capsys):
    published = published_without_npu() + [f"--set=run_dir={tmp_path / 'run'}"]
    assert main(["train", "--from-verl", str(recipe), *published, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "dynamic_sampling_metric: acc" in captured.out and "val_top_p: 0.7" in captured.out
    assert captured.err.startswith("verl settings rlmega takes differently (")
    assert "| `actor_rollout_ref.actor.fsdp_config.param_offload` | `true` | actor.offload=true |" in captured.err
    assert main(["train", "--from-verl", str(recipe), *DAPO_QWEN25_32B_NPU, "critic.model.lora_rank=8",
                 "--print-config"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "verl settings rlmega refuses (2):"
    assert any(line.startswith("| `trainer.device` | `npu` | refused |") for line in lines)
    assert any(line.startswith("| `critic.model.lora_rank` | `8` | refused |") for line in lines)
    assert lines[-1] == ("rlmega train: 2 verl settings cannot cross over (the table above says why): "
                         "critic.model.lora_rank, trainer.device; change or remove them and run again")


def test_the_script_on_32_h100_lands_on_the_recipe_with_the_searched_layout(recipe, capsys, monkeypatch):
    """The FSDP script names no Megatron layout: --from-verl runs the layout search and reports the choice."""
    root = recipe.parents[2]
    monkeypatch.chdir(root)
    changed = {"actor_rollout_ref.model.path": "configs/recipes/qwen2_5_32b/hf", "trainer.nnodes": "4",
               "trainer.n_gpus_per_node": "8"}
    script = [f"{key}={changed[key]}" if key in changed else f"{key}={value}"
              for key, value in (override.split("=", 1) for override in published_without_npu())]
    assert main(["train", "--from-verl", str(recipe), *script, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "rlmega plan --search chose tp2 pp4 cp4 dp1 for 32 H100" in captured.err
    assert "lowest predicted step time" in captured.err
    # The script's own Ulysses degree and engine TP, replaced by the search, are rows of the report too.
    replaced = captured.err.split("translated settings the layout search replaced")[1]
    assert "| `layout.cp` | `8` | `layout.cp=4` |" in replaced
    assert "| `rollout.tensor_parallel_size` | `4` | `rollout.tensor_parallel_size=8` |" in replaced
    import yaml
    printed = yaml.safe_load(captured.out)
    shipped = load_config("configs/recipes/qwen2_5_32b/dapo.yaml", check=False)
    for section, names in (("layout", ("world_size", "tp", "pp", "cp", "vpp", "ep")),
                           ("rollout", ("n", "max_new_tokens", "tensor_parallel_size", "num_engines", "top_p")),
                           ("trainer", ("prompts_per_step",)), ("algorithm", ("max_generation_rounds",
                                                                             "overlong_buffer_length"))):
        for name in names:
            assert printed[section][name] == getattr(getattr(shipped, section), name), f"{section}.{name}"
    actor = printed["actor"]
    assert actor["recompute_granularity"] is None and actor["optimizer"]["cpu_offload_fraction"] == 0.5
    assert actor["batching"]["max_tokens_per_microbatch"] == shipped.actor.batching.max_tokens_per_microbatch
    assert actor["policy_loss"]["clip_ratio_high"] == shipped.actor.policy_loss.clip_ratio_high == 0.28


def test_a_script_whose_model_cannot_be_read_keeps_the_degrees_and_says_so(recipe, capsys):
    assert main(["train", "--from-verl", str(recipe), *published_without_npu(), "--print-config"]) == 0
    err = capsys.readouterr().err
    assert "/home/user/verl/models/Qwen2.5-32B/config.json cannot be read" in err and "layout.tp=2 layout.pp=1 stay" in err  # tiny_cpu's

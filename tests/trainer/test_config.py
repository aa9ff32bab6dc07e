"""The config tree: shipped configs load and validate, errors name the field, every field is read."""

import dataclasses
import re
from pathlib import Path

import pytest

from rlmega.config import CONFIG_DIR, ConfigError, RLConfig, load_config, validate
from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.tiny_reward_model import prepare_tiny_reward_model
from rlmega.trainer.tiny_teacher import prepare_tiny_teacher

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    paths = prepare_tiny_assets(run_dir / "assets", num_train=64, num_val=16)
    # configs/tiny_cpu_rm.yaml's reward model (a few steps: only its checkpoint is checked here)
    prepare_tiny_reward_model(run_dir / "assets" / "reward_model", policy_dir=paths["model"],
                              train_files=[paths["train"]], steps=4, prompts_per_step=4)
    # configs/tiny_cpu_opd.yaml's teacher (likewise a few steps)
    prepare_tiny_teacher(run_dir / "assets" / "teacher", policy_dir=paths["model"], train_files=[paths["train"]],
                         steps=4, batch_size=4)
    return run_dir


ESTIMATOR_OF_ALGO = {"dapo": "grpo", "grpo": "grpo", "ppo": "gae", "reinforce_plus_plus": "reinforce_plus_plus",
                     "rloo": "rloo"}


@pytest.mark.parametrize("algo", sorted(p.stem for p in (CONFIG_DIR / "algo").glob("*.yaml")))
def test_every_shipped_config_loads_and_validates(run_dir, algo):
    for config_file in sorted(CONFIG_DIR.glob("*.yaml")):
        config = load_config(config_file.stem, [f"run_dir={run_dir}", f"algo={algo}"])
        assert isinstance(config, RLConfig) and config.algorithm.adv_estimator == ESTIMATOR_OF_ALGO[algo]
        assert config.needs_critic == (algo == "ppo")


def test_overrides_and_algorithm_groups_apply(run_dir):
    config = load_config("tiny_cpu", [f"run_dir={run_dir}", "algo=dapo", "trainer.total_steps=7", "rollout.n=3"])
    assert config.trainer.total_steps == 7 and config.rollout.n == 3
    assert config.algorithm.dynamic_sampling and config.actor.policy_loss.clip_ratio_high == 0.28
    assert config.model.path == f"{run_dir}/assets/model"  # interpolation of run_dir


@pytest.mark.parametrize("override, message", [
    ("trainer.totl_steps=3", "totl_steps"),
    ("trainer.total_steps=many", "total_steps"),
    ("rollout.placement=everywhere", "rollout.placement"),
    ("algorithm.adv_estimator=sarsa", "algorithm.adv_estimator: 'sarsa' is not one of dr_grpo, gae"),
    ("actor.policy_loss.name=ppo2", "actor.policy_loss.name: 'ppo2' is not one of"),
    ("actor.policy_loss.tau_pos=1.0", "policy_loss.tau_pos is not a parameter of policy loss 'ppo'"),
    ("actor.policy_loss.kl_estimator=k9", "actor.policy_loss.kl_estimator"),
    ("sync.transport=pigeon", "sync.transport: 'pigeon' is not one of auto"),
    ("algorithm.rollout_correction.rollout_rs=token", "rollout_rs_threshold is required"),
    ("layout.pp=2", "layout"),
    ("rollout.backend=trt", "rollout.backend: 'trt' is not one of hf, vllm, sglang"),
    ("resume=sometimes", "resume: 'sometimes' is not one of auto, never"),
    ("layout.first_stage_layers=1", "need pipeline parallelism"),
    ("rollout.tensor_parallel_size=2", "the hf engine runs on one device"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization: must be in (0, 1]"),
    ("trainer.total_epochs=0", "trainer.total_epochs: must be >= 1"),
    ("trainer.max_checkpoints_to_keep=0", "trainer.max_checkpoints_to_keep"),
    ("actor.recompute_method=block", "need recompute_granularity=full"),
    ("layout.tp=3", "layout"),
    ("layout.cp=0", "cp"),
    ("data.files=[/nonexistent.parquet]", "data.files"),
    ("rollout.n=1", "rollout.n"),
    ("actor.optimizer.lr_schedule=sawtooth", "lr_schedule"),
    ("sync.post_sync_atol=0", "sync.post_sync_atol: must be > 0 (null: chosen by the run's precision)"),
])
def test_bad_values_are_refused_by_name(run_dir, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny_cpu", [f"run_dir={run_dir}", override])


def test_uneven_pipeline_stages_are_settable(run_dir):
    config = load_config("tiny_cpu", [f"run_dir={run_dir}", "layout.pp=2", "layout.tp=1", "layout.first_stage_layers=1",
                                      "layout.last_stage_layers=1"])
    layout = config.layout.build()
    assert layout.uneven_stages and (layout.first_stage_layers, layout.last_stage_layers, layout.pp) == (1, 1, 2)
    with pytest.raises(ConfigError, match="first_stage_layers=2 and last_stage_layers=1 leaves -1 layers"):
        load_config("tiny_cpu", [f"run_dir={run_dir}", "layout.pp=2", "layout.tp=1", "layout.first_stage_layers=2",
                                 "layout.last_stage_layers=1"])


def test_engine_fields_reach_each_backend_by_its_own_names(run_dir):
    # A joined cluster provides the GPUs (this machine may have none).
    common = [f"run_dir={run_dir}", "cluster.ray_address=auto", "rollout.gpus_per_engine=4",
              "rollout.tensor_parallel_size=2", "rollout.data_parallel_size=2", "rollout.expert_parallel_size=4",
              "rollout.gpu_memory_utilization=0.7", "rollout.max_num_batched_tokens=8192",
              "+rollout.engine_kwargs.enforce_eager=true"]
    # The names, unchecked: an engine's data parallelism is refused at load (vLLM and SGLang cannot run it in one
    # process; rlmega runs separate engines instead), but each backend still has its own name for it.
    vllm = load_config("tiny_cpu", [*common, "rollout.backend=vllm"], check=False).rollout.engine_arguments()
    assert vllm == {"gpu_memory_utilization": 0.7, "tensor_parallel_size": 2, "data_parallel_size": 2,
                    "max_num_batched_tokens": 8192, "enable_expert_parallel": True, "enforce_eager": True}
    with pytest.raises(ConfigError, match="rollout.data_parallel_size: vLLM refuses .* rollout.num_engines=2"):
        load_config("tiny_cpu", [*common, "rollout.backend=vllm"])
    sglang = load_config("tiny_cpu", [*common, "rollout.backend=sglang"], check=False).rollout.engine_arguments()
    assert sglang == {"mem_fraction_static": 0.7, "tp_size": 2, "dp_size": 2, "ep_size": 4,
                      "max_prefill_tokens": 8192, "enforce_eager": True}
    with pytest.raises(ConfigError, match="rollout.engine_kwargs.tp_size: set rollout.tensor_parallel_size instead"):
        load_config("tiny_cpu", [*common, "rollout.backend=sglang", "rollout.data_parallel_size=1",
                                 "rollout.gpus_per_engine=2", "+rollout.engine_kwargs.tp_size=2"])
    with pytest.raises(ConfigError, match="needs that many GPUs, got 2"):
        load_config("tiny_cpu", [*common, "rollout.backend=vllm", "rollout.data_parallel_size=1",
                                 "rollout.gpus_per_engine=2", "rollout.tensor_parallel_size=4"])


@pytest.mark.parametrize("overrides, atol", [
    ([], 1e-3),  # CPU: fp32 trainer, fp32 hf engine
    (["cluster.gpus_per_rank=1", "rollout.gpus_per_engine=1"], 0.5),  # CUDA: bf16 on both sides by default
    (["cluster.gpus_per_rank=1", "actor.dtype=fp32", "rollout.gpus_per_engine=1",
      "+rollout.engine_kwargs.dtype=float32"], 1e-3),
    (["cluster.gpus_per_rank=1", "actor.dtype=fp32", "rollout.gpus_per_engine=1"], 0.5),  # hf engine in bf16
    (["cluster.gpus_per_rank=1", "actor.dtype=fp32", "rollout.backend=vllm", "rollout.gpus_per_engine=1"], 0.5),
    (["cluster.gpus_per_rank=1", "actor.dtype=fp32", "rollout.backend=sglang", "rollout.gpus_per_engine=1",
      "+rollout.engine_kwargs.dtype=float32"], 1e-3),
    (["actor.dtype=bf16"], 0.5),
    (["cluster.gpus_per_rank=1", "rollout.gpus_per_engine=1", "sync.post_sync_atol=0.05"], 0.05),
])
def test_the_post_sync_tolerance_follows_the_precision_of_both_sides(run_dir, overrides, atol):
    # A joined cluster provides the GPUs (this machine may have none).
    config = load_config("tiny_cpu", [f"run_dir={run_dir}", "cluster.ray_address=auto", *overrides])
    assert config.post_sync_atol() == atol


def test_the_run_takes_the_prompts_the_checks_read(run_dir, tmp_path):
    """Read and tokenized once: the checks hand their datasets to the run, which reads no data file again."""
    import shutil

    from rlmega.trainer.prompt_side import build_prompt_side

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        shutil.copy(run_dir / "assets" / f"{split}.parquet", data)
    config = load_config("tiny_cpu", [f"run_dir={run_dir}", f"data.files=[{data / 'train.parquet'}]",
                                      f"val_data.files=[{data / 'val.parquet'}]"], check=False)
    datasets = validate(config)
    shutil.rmtree(data)
    prompts = build_prompt_side(config, datasets)
    try:
        assert prompts.data.dataset is datasets.train and prompts.data.val_dataset is datasets.val
        assert len(prompts.data.dataset) == 64 and len(prompts.data.val_dataset) == 16
    finally:
        prompts.close()


def test_missing_model_names_the_field(tmp_path):
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}"], check=False)
    with pytest.raises(ConfigError, match="model.path"):
        validate(config)


def _fields(cls, seen=None):
    seen = set() if seen is None else seen
    for field in dataclasses.fields(cls):
        yield cls, field.name
        nested = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested) and type(nested) not in seen:
            seen.add(type(nested))
            yield from _fields(type(nested), seen)


def test_every_config_field_is_read_somewhere():
    """Each field name appears as an attribute read (``.name``) in rlmega's code (a definition,
    ``name: type = default``, has no dot, so it does not count), or in one of the tuples of fields
    that are read by name (``getattr``) and passed on as keyword arguments."""
    from rlmega.config.schema import ENGINE_ARGUMENTS
    from rlmega.trainer.advantages import CONFIG_INPUTS
    from rlmega.workers.config import LOSS_PARAMETERS

    sources = "\n".join(path.read_text() for path in (ROOT / "rlmega").rglob("*.py"))
    by_name = set(CONFIG_INPUTS.values()) | set(LOSS_PARAMETERS) | {f for names in ENGINE_ARGUMENTS.values() for f in names}
    unread = [f"{cls.__name__}.{name}" for cls, name in _fields(RLConfig)
              if name not in by_name and not re.search(rf"\.{name}\b", sources)]
    assert not unread, f"config fields nothing reads: {unread}"


def test_sequence_parallelism_default_follows_the_devices_and_the_model():
    from rlmega.workers.config import WorkerConfig

    default, off, on = WorkerConfig(), WorkerConfig(sequence_parallel=False), WorkerConfig(sequence_parallel=True)
    assert default.uses_sequence_parallel(2, moe=False, gpu=True)  # less activation memory on GPUs
    assert not default.uses_sequence_parallel(2, moe=False, gpu=False)  # gloo's collectives cost more than it saves
    assert default.uses_sequence_parallel(2, moe=True, gpu=False)  # Megatron requires it for MoE with tp > 1
    assert not default.uses_sequence_parallel(1, moe=True, gpu=True)  # nothing to split at tp 1
    assert on.uses_sequence_parallel(2, moe=False, gpu=False) and not off.uses_sequence_parallel(2, moe=True, gpu=True)

"""Loading a run's configuration: schema defaults <- YAML <- command-line overrides, then validation.

Hydra composes the YAML (its ``defaults`` list can pull config groups such as ``algo: dapo``) on
top of the ``RLConfig`` schema registered in Hydra's ConfigStore; unknown keys and wrong types are
refused by name. ``validate`` then checks what types cannot (sizes, files exist, sizes divide, the
layout fits the model, GPUs exist, the reward function is in its file, every data row parses and
fits ``max_prompt_length``) once, before anything starts.

Errors: every refusal is a ``rlmega.errors.UserError`` with a one-line message that says what is
wrong, where, and how to fix it; ``rlmega <command>`` prints it as ``rlmega <command>: <message>``
and exits with code 2, before Ray or any worker starts. For example:

    trainer.totl_epochs: no such field; did you mean trainer.total_epochs?
    trainer.prompts_per_step: expected an int, got 'abc'
    algo=grpoo: no such option; choose one of dapo, grpo, ppo, reinforce_plus_plus, rloo
    my_run.yaml line 6: not valid YAML: mapping values are not allowed here (column 13)
    rollout.max_new_tokens: must be an int >= 1, got 0
    data/train.jsonl line 3: not valid JSON (Expecting value at column 1); each line must hold one JSON object

``ConfigError`` is a setting's (``rlmega.config.explain`` turns Hydra's and OmegaConf's errors into
these lines), ``rlmega.data.DataFormatError`` a data file's.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

from rlmega.config.engine_layout import layout_problems
from rlmega.config.engine_sampling import sampling_problems, sampling_warnings
from rlmega.config.explain import explain, extra_keys, no_such_field
from rlmega.config.schema import RLConfig
from rlmega.config.frozen_checkpoint import frozen_checkpoint_problem
from rlmega.config.teacher_checks import check_teacher_inputs, teacher_problems
from rlmega.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SCHEMA_NAME = "rlmega_schema"


class ConfigError(UserError):
    """A configuration value that cannot work; the message starts with the field's dotted name (after
    the YAML file's path when the file holds the value)."""


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLConfig)


def _locate(name_or_path: str) -> tuple[Path, str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        return path.resolve().parent, path.stem
    if not (CONFIG_DIR / f"{name_or_path}.yaml").is_file():
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"--config: no config named {name_or_path!r} in {CONFIG_DIR}; available: {', '.join(available)}")
    return CONFIG_DIR, name_or_path


def load_config(name_or_path: str = "tiny_cpu", overrides: Sequence[str] = (), *, check: bool = True) -> RLConfig:
    """The run configuration from a config name (``configs/<name>.yaml``) or a YAML path, with
    Hydra-syntax ``overrides`` (``trainer.total_steps=10``, ``algo=dapo``). Validated unless ``check=False``."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    directory, name = _locate(name_or_path)
    overrides = list(overrides)
    # A YAML outside configs/ can still pick the shipped groups (algo=dapo); its own folder comes first.
    search_path = [] if directory == CONFIG_DIR else [f"hydra.searchpath=[file://{CONFIG_DIR}]"]
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            composed = compose(config_name=name, overrides=search_path + overrides)
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as error:
        raise ConfigError(explain(error, overrides, (directory, CONFIG_DIR))) from error
    except (ValueError, TypeError) as error:  # a component config's own check (__post_init__)
        raise ConfigError(f"{name_or_path}: {error}") from error
    if not isinstance(config, RLConfig):
        raise ConfigError(f"{name_or_path}: the YAML must list '{SCHEMA_NAME}' first in its defaults")
    unknown = next(extra_keys(config), None)
    if unknown is not None:
        raise ConfigError(no_such_field(unknown, overrides))
    if check:
        validate(config)
    return config


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")


def validate(config: RLConfig):
    """Raise a UserError naming the first field, file or row that cannot work: ConfigError for a
    setting, DataFormatError for a dataset row. The data files are read and tokenized here, once: the
    ``rlmega.data.PromptDatasets`` returned are the run's (``build_prompt_side(config, datasets)``)."""
    check_settings(config)
    return check_inputs(config)


def check_settings(config: RLConfig) -> None:
    """The checks that read no model and no data: everything that can be refused before files the run builds
    itself (``tiny_assets``) exist."""
    from rlmega.rewards.user_function import check_function_defined

    from rlmega import algos

    _check_choices(config, "")
    for field, minimum in COUNTS.items():
        value = _get(config, field)
        _require(type(value) is int and value >= minimum, field, f"must be an int >= {minimum}, got {value!r}")
    _require(config.algorithm.adv_estimator in algos.ADVANTAGE_ESTIMATORS, "algorithm.adv_estimator",
             f"{config.algorithm.adv_estimator!r} is not one of {', '.join(sorted(algos.ADVANTAGE_ESTIMATORS))}")
    for role in ("actor", "ref", "critic"):
        loss = getattr(config, role).policy_loss
        _require(loss.name in algos.POLICY_LOSS_CONFIGS, f"{role}.policy_loss.name",
                 f"{loss.name!r} is not one of {', '.join(sorted(algos.POLICY_LOSS_CONFIGS))}")
        _require(loss.kl_estimator in algos.KL_ESTIMATORS, f"{role}.policy_loss.kl_estimator",
                 f"{loss.kl_estimator!r} is not one of {', '.join(sorted(algos.KL_ESTIMATORS))}")
        _require(loss.loss_agg_mode in algos.LOSS_AGG_MODES, f"{role}.policy_loss.loss_agg_mode",
                 f"{loss.loss_agg_mode!r} is not one of {', '.join(algos.LOSS_AGG_MODES)}")
    for role in ("actor", "critic"):
        optimizer = getattr(config, role).optimizer
        _require(not optimizer.cpu_offload_fraction or optimizer.distributed_optimizer is not False,
                 f"{role}.optimizer.cpu_offload_fraction", "needs the distributed optimizer: set "
                 f"{role}.optimizer.distributed_optimizer to null or true")
    try:
        config.actor.policy_loss.loss_config()
    except ValueError as error:
        raise ConfigError(f"actor.{error}") from error
    for field, problem in config.algorithm.distill.problems(config.teacher.enable, config.teacher.top_k):
        raise ConfigError(f"algorithm.distill.{field}: {problem}")
    for key, problem in config.sync.problems(config.rollout.backend, bool(config.rollout.restart_dead_engines),
                                             config.rollout.gpus_of_one_engine, config.actor.lora.rank,
                                             config.rollout.weight_dtype, config.actor.lora.target_modules):
        raise ConfigError(f"{key}: {problem}")
    _require(config.rollout.num_engines >= 1, "rollout.num_engines", "must be >= 1")
    if config.gateway.enabled:
        _require(not config.agent.enabled, "gateway.enabled",
                 "the harness makes the trajectories, so agent.enabled must be false (use one or the other)")
    _check_devices(config)
    rollout = config.rollout
    for field in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size"):
        _require(getattr(rollout, field) >= 1, f"rollout.{field}", "must be >= 1")
        _require(rollout.backend != "hf" or getattr(rollout, field) == 1, f"rollout.{field}",
                 "the hf engine runs on one device; engine parallelism needs rollout.backend=vllm or sglang")
    _require(0 < rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
    _require(rollout.val_temperature >= 0, "rollout.val_temperature", "must be >= 0 (0: greedy)")
    _require(rollout.val_top_p is None or 0 < rollout.val_top_p <= 1, "rollout.val_top_p",
             "must be in (0, 1], or null for rollout.top_p")
    _require(rollout.val_top_k is None or rollout.val_top_k >= 0, "rollout.val_top_k",
             "must be >= 0 (0: no top-k), or null for rollout.top_k")
    for field, problem in sampling_problems(config) + layout_problems(config):
        raise ConfigError(f"{field}: {problem}")
    for note in sampling_warnings(config):
        warnings.warn(note, stacklevel=2)
    engine_gpus = rollout.gpus_of_one_engine
    _require(rollout.backend == "hf" or rollout.gpus_per_engine in (0, engine_gpus), "rollout.gpus_per_engine",
             f"an engine with tensor_parallel_size x data_parallel_size = {engine_gpus} needs that many GPUs, "
             f"got {rollout.gpus_per_engine}")
    try:
        rollout.engine_arguments()
    except ValueError as error:
        raise ConfigError(str(error)) from error
    # These transports hand a vLLM / SGLang engine's loader tensors the bridge did not quantize, where its FP8
    # layers need FP8 ones; the others carry the sync's quantized buckets, or go through the adapter.
    _require(rollout.weight_dtype != "fp8" or rollout.backend == "hf"
             or config.sync.transport not in ("sharded_rdt", "sliced"), "rollout.weight_dtype",
             f"fp8 engines of rollout.backend={rollout.backend} cannot take sync.transport={config.sync.transport} "
             "(it delivers unquantized tensors straight to the engine's loader); use sync.transport=auto, "
             "in_process, shared_memory, object_store or broadcast")
    _require(rollout.mode == "sync" or rollout.placement == "disaggregated", "rollout.mode",
             f"{rollout.mode} overlaps generation with training, so the engines need resources of their own: "
             "set rollout.placement=disaggregated")
    _require(rollout.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
    _require(not rollout.restart_dead_engines or rollout.mode != "one_step_off", "rollout.restart_dead_engines",
             "one_step_off generates the next step while the ranks train, so they cannot give a restarted engine "
             "the weights that step is generated from; use rollout.mode=sync or async, or set it to 0")
    if config.cluster.in_process == "always":
        obstacles = config.in_process_obstacles()
        _require(not obstacles, "cluster.in_process", "always, but this run cannot run in one process: "
                 f"{'; '.join(obstacles)}. Set cluster.in_process=auto to run it on Ray")
    _require(rollout.mode != "async" or config.algorithm.adv_estimator != "remax", "rollout.mode",
             "async cannot give remax the greedy baseline of the same weights; use sync or one_step_off")
    trainer = config.trainer
    _require(trainer.total_epochs is None or trainer.total_epochs >= 1, "trainer.total_epochs", "must be >= 1 or null")
    _require(trainer.max_checkpoints_to_keep is None or trainer.max_checkpoints_to_keep >= 1,
             "trainer.max_checkpoints_to_keep", "must be >= 1 or null (keep all)")
    _require(trainer.log_val_generations >= 0 and trainer.critic_warmup >= 0,
             "trainer.log_val_generations / trainer.critic_warmup", "must be >= 0")
    _require(not config.algorithm.dynamic_sampling or config.rollout.n > 1, "algorithm.dynamic_sampling",
             "needs rollout.n > 1 (a group of one always has equal scores)")
    _require(bool(config.algorithm.dynamic_sampling_metric.strip()), "algorithm.dynamic_sampling_metric",
             "must name a value: shaped_score, score, or a number the reward function returns (e.g. acc)")
    _require(config.algorithm.adv_estimator not in GROUP_ESTIMATORS or config.rollout.n > 1, "rollout.n",
             f"{config.algorithm.adv_estimator} compares responses within a group: needs n > 1")
    responses = config.trainer.prompts_per_step * config.rollout.n
    _require(responses >= config.actor.ppo_mini_batches, "actor.ppo_mini_batches",
             f"{config.actor.ppo_mini_batches} mini-batches need at least as many responses per step, got {responses}")
    _require(config.actor.role == "actor" and config.ref.role == "ref" and config.critic.role == "critic",
             "actor.role / ref.role / critic.role", "must stay actor, ref and critic")
    if config.reward.user_function is not None:
        check_function_defined(config.reward.user_function)
    _check_reward_weights(config)
    for field, problem in teacher_problems(config):
        raise ConfigError(f"{field}: {problem}")


def check_inputs(config: RLConfig):
    """The model, the reward model, the judge and the data: files exist and fit the settings. Returns the prompt
    datasets, read and tokenized (``rlmega.data.PromptDatasets``)."""
    from rlmega.bridge import CheckpointError, HFCheckpoint
    from rlmega.models import UnsupportedModelError, model_spec_from_hf
    from rlmega.parallel.layout import LayoutError

    model_dir = Path(config.model.path)
    _require((model_dir / "config.json").is_file(), "model.path", f"no HF checkpoint (config.json) at {model_dir}")
    for field, data in (("data.files", config.data), ("val_data.files", config.val_data)):
        if field == "val_data.files" and not config.trainer.val_every:
            continue
        _require(bool(data.files), field, "no dataset files given")
        for file in data.files:
            _require(Path(file).is_file(), field, f"no such file {file}")
    try:
        spec = model_spec_from_hf(str(model_dir), mtp=config.model.mtp)
    except UnsupportedModelError as error:
        raise ConfigError(f"model.path: {error}") from error
    for note in spec.notes:  # said once, here: the workers build the same spec silently
        print(f"note: model.path: {note}", file=sys.stderr)
    try:
        spec.check_layout(config.layout.build())
    except LayoutError as error:
        raise ConfigError(f"layout: {error}") from error
    _check_fp8_slices(config, model_dir)
    try:  # every safetensors file's header: a missing or damaged shard is named before anything starts
        HFCheckpoint(model_dir)
    except (CheckpointError, FileNotFoundError) as error:
        raise ConfigError(f"model.path: {error}") from None
    _check_router_replay(config, spec)
    _check_lora_experts(config, spec)
    _check_reward_model(config)
    _check_judge(config)
    check_teacher_inputs(config, ConfigError)
    return _check_data(config)


def _check_lora_experts(config: RLConfig, spec) -> None:
    """Expert adapters need experts, and dropout on ``experts.linear_fc1`` needs whole expert inputs (``etp=1``)."""
    from rlmega.models.lora import EXPERT_MODULES

    lora = config.actor.lora
    experts = sorted(set(lora.target_modules) & set(EXPERT_MODULES))
    if not lora.enabled or not experts:
        return
    _require(bool(spec.num_experts), "actor.lora.target_modules",
             f"{', '.join(experts)} adapt a MoE model's experts; this model has none: drop them")
    _require(not lora.dropout or "experts.linear_fc1" not in experts or config.layout.build().expert_tp == 1,
             "actor.lora.dropout", "dropout on experts.linear_fc1 needs layout.etp=1 (expert-TP ranks must drop the "
             "same elements of an expert's input); set layout.etp=1 or actor.lora.dropout=0")


def _check_fp8_slices(config: RLConfig, model_dir: Path) -> None:
    """An FP8 engine's TP slices hold whole 128 x 128 blocks (``rlmega.rollout.fp8_slices``); the hf engine is not
    split."""
    import json

    from rlmega.rollout.fp8_slices import fp8_tp_problem

    rollout = config.rollout
    if rollout.weight_dtype != "fp8" or rollout.backend == "hf":
        return
    hf_config = json.loads((model_dir / "config.json").read_text())
    problem = fp8_tp_problem(hf_config.get("text_config", hf_config), rollout.tensor_parallel_size,
                             expert_parallel=rollout.expert_parallel_size > 1)
    _require(problem is None, "rollout.tensor_parallel_size", problem)


def _check_router_replay(config: RLConfig, spec) -> None:
    replay = config.actor.router_replay
    for role in ("ref", "critic"):
        _require(getattr(config, role).router_replay == "none", f"{role}.router_replay",
                 "only the actor replays routing; the other roles route by themselves")
    if replay == "none":
        return
    _require(bool(spec.num_experts), "actor.router_replay", f"{replay} replays MoE routing; {config.model.path} has no experts")
    if replay == "r3" and config.rollout.backend == "vllm":  # what vLLM 0.33 refuses with routed-expert capture
        kwargs = config.rollout.engine_kwargs or {}
        _require(kwargs.get("enable_prefix_caching", True) is not False, "rollout.engine_kwargs.enable_prefix_caching",
                 "vLLM returns routed experts (actor.router_replay=r3) only with prefix caching on")
        _require(int(kwargs.get("pipeline_parallel_size", 1)) == 1, "rollout.engine_kwargs.pipeline_parallel_size",
                 "vLLM returns routed experts (actor.router_replay=r3) only without pipeline parallelism")
    _require(replay != "r3" or not config.agent.enabled, "actor.router_replay",
             "r3 with agent rollouts is not supported yet (tool output is tokenised, not routed, by the engine); use r2")
    _require(replay != "r3" or config.rollout.mode == "sync", "actor.router_replay",
             "r3 with an asynchronous rollout mode is not supported yet: a response continued with new weights "
             "has routing from two versions; use r2 or rollout.mode=sync")
    _require(not config.algorithm.rollout_correction.bypass_mode, "actor.router_replay",
             "r2 records routing in the old-log-prob pass, which bypass_mode skips")


# Sizes that must be whole numbers, with their least value.
COUNTS = {"rollout.n": 1, "rollout.max_new_tokens": 1, "trainer.total_steps": 1, "trainer.prompts_per_step": 1,
          "trainer.val_prompts": 1, "trainer.sft_steps": 0, "trainer.save_every": 0, "trainer.val_every": 0,
          "reward_model.max_tokens_per_microbatch": 1, "judge.response_length": 1, "judge.num_engines": 1,
          "judge.tensor_parallel_size": 1, "rollout.restart_dead_engines": 0, "rollout.restart_window_steps": 1,
          "rollout.val_n": 1}


def _reward_weights(config: RLConfig):
    from rlmega.rewards import RewardWeights, enabled_components

    return RewardWeights(config.reward, enabled_components(
        user_function=config.reward.user_function is not None, reward_model=config.reward_model.enable,
        judge=config.judge.enable))


def _check_reward_weights(config: RLConfig) -> None:
    try:
        _reward_weights(config).check()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_hf_dir(field: str, path, what: str) -> None:
    _require(path is not None and (Path(path) / "config.json").is_file(), field,
             f"no HF checkpoint (config.json) at {path}; the {what} needs one")


def _check_model_scores(section: str, settings) -> None:
    """The normalisation and clipping fields shared by the reward model and the judge."""
    clip = settings.clip_range
    _require(clip is None or (len(clip) == 2 and clip[0] < clip[1]), f"{section}.clip_range",
             f"must be [low, high] with low < high, or null; got {clip}")


def _load_tokenizer(field: str, source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: no tokenizer loads from {source} ({str(error).splitlines()[0]})") from None


def _check_reward_model(config: RLConfig) -> None:
    """The reward model: a one-label sequence-classification checkpoint that fits its layout, a tokenizer,
    and a chat template wherever the response must be re-tokenised."""
    from rlmega.rewards import same_tokenization

    reward = config.reward_model
    if not reward.enable:
        return
    problem = frozen_checkpoint_problem("reward_model", reward.path, reward.layout, "reward")
    if problem:
        raise ConfigError(f"{problem[0]}: {problem[1]}")
    _require(reward.cpus_per_rank > 0, "reward_model.cpus_per_rank", "must be > 0")
    _check_model_scores("reward_model", reward)
    field = "reward_model.tokenizer_path" if reward.tokenizer_path else "reward_model.path"
    tokenizer = _load_tokenizer(field, reward.tokenizer_path or reward.path)
    if reward.chat_template is not None:
        tokenizer.chat_template = reward.chat_template
    policy = _load_tokenizer("model.tokenizer_path" if config.model.tokenizer_path else "model.path",
                             config.model.tokenizer_path or config.model.path)
    retokenizes = reward.retokenize == "always" or (reward.retokenize == "auto"
                                                    and not same_tokenization(tokenizer, policy))
    _require(not retokenizes or tokenizer.chat_template is not None, "reward_model.chat_template",
             f"the reward model's tokenizer ({field}) has no chat template to render prompt + response with; "
             "set reward_model.chat_template")


def _check_judge(config: RLConfig) -> None:
    from rlmega.rewards.judge import check_template
    from rlmega.rewards.user_function import check_function_defined

    judge = config.judge
    if not judge.enable:
        return
    _check_hf_dir("judge.path", judge.path, "judge")
    field = "judge.tokenizer_path" if judge.tokenizer_path else "judge.path"
    _load_tokenizer(field, judge.tokenizer_path or judge.path)
    try:
        check_template(judge.prompt_template)
    except ValueError as error:
        raise ConfigError(f"judge.prompt_template: {error}") from None
    if judge.parser is not None:
        try:
            check_function_defined(judge.parser, field="judge.parser")
        except ValueError as error:  # a malformed spec or a missing file (a UserError passes as it is)
            if isinstance(error, UserError):
                raise
            raise ConfigError(f"judge.parser: {error}") from None
    _require(judge.temperature >= 0, "judge.temperature", f"must be >= 0, got {judge.temperature}")
    _require(judge.cpus_per_engine > 0, "judge.cpus_per_engine", "must be > 0")
    _require(0 < judge.gpu_memory_utilization <= 1, "judge.gpu_memory_utilization", "must be in (0, 1]")
    _require(judge.backend != "hf" or judge.tensor_parallel_size == 1, "judge.tensor_parallel_size",
             "the hf engine runs on one device; engine parallelism needs judge.backend=vllm or sglang")
    try:
        judge.engine_config().engine_arguments()
    except ValueError as error:
        raise ConfigError(str(error).replace("rollout.", "judge.")) from None
    _check_model_scores("judge", judge)


def _get(config: RLConfig, dotted: str):
    value = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def _check_devices(config: RLConfig) -> None:
    """GPUs asked of a local Ray that this machine cannot give (a joined cluster's nodes may have them)."""
    if config.cluster.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    for field in ("rollout.gpus_per_engine", "cluster.gpus_per_rank", "reward_model.gpus_per_rank",
                  "judge.gpus_per_engine", "teacher.gpus_per_rank"):
        value = _get(config, field)
        if value > 0:
            import torch

            if torch.cuda.device_count() == 0:
                raise ConfigError(f"{field}={value:g} asks for GPUs, but this machine has none "
                                  "(torch.cuda.device_count() == 0); set it to 0 or join a Ray cluster with GPUs "
                                  "via cluster.ray_address")


def _check_data(config: RLConfig):
    """Read and tokenize the datasets as the run will (a vision-language model's images processed), so that a bad
    file or row is refused with the other checks, before anything starts (DataFormatError naming the file and row);
    returns them (``rlmega.data.PromptDatasets``) for the run."""
    from transformers import AutoTokenizer

    from rlmega.data import DataFormatError, PromptDatasets
    from rlmega.data.images import image_prompts_for
    from rlmega.rewards import RULE_SCORERS

    field = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
    source = config.model.tokenizer_path or config.model.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: no tokenizer loads from {source} ({str(error).splitlines()[0]})") from None
    processor = image_prompts_for(config.model.path, config.model.tokenizer_path, tokenizer,
                                  multi_turn=config.agent.enabled)
    prompts = PromptDatasets.read(config.data, config.val_data if config.trainer.val_every else None, tokenizer,
                                  processor)
    dataset = prompts.train
    prompts_per_step = config.trainer.prompts_per_step
    filtered = f" ({dataset.num_filtered} more were longer than data.max_prompt_length)" if dataset.num_filtered else ""
    _require(prompts_per_step <= len(dataset), "trainer.prompts_per_step",
             f"{prompts_per_step} prompts per step, but data.files hold {len(dataset)}{filtered}; "
             "lower trainer.prompts_per_step or add prompts")
    weights = _reward_weights(config)  # only the rows the rule component scores need a rule scorer
    unscored = next((r for data, validation in ((prompts.train, False), (prompts.val, True)) if data is not None
                     for r in data.records
                     if r.data_source not in RULE_SCORERS
                     and weights.runs("rule", r.data_source, validation=validation)), None)
    if unscored is not None:
        raise DataFormatError(
            f"{unscored.source_file} row {unscored.source_row}: no rule scorer for data_source "
            f"{unscored.data_source!r}; valid: {', '.join(sorted(RULE_SCORERS))}; or score every row with "
            "reward.user_function=path/to/file.py:function")
    return prompts


def check_choices(config: RLConfig) -> None:
    """Every field declared with ``schema.choice`` holds one of its options (the first of ``validate``'s
    checks, for tools that read a config without its data and weights, such as ``rlmega plan``)."""
    _check_choices(config, "")


def _check_choices(node, prefix: str) -> None:
    """Every field declared with ``schema.choice`` holds one of its options (the first wrong one is named)."""
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if "choices" in field.metadata:
            _require(value in field.metadata["choices"], prefix + field.name,
                     f"{value!r} is not one of {', '.join(field.metadata['choices'])}")
        elif dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{field.name}.")


# Estimators that centre each response's score on its group's: a group of one has nothing to compare with.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "grpo_passk", "gpg", "rloo", "reinforce_plus_plus_baseline")




def to_yaml(config: RLConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))

"""The rules of verl's settings: how a verl value becomes an rlmega value (``(value, verl) -> value``, SKIP,
or ``raise Refused``), and the name tables they read (estimators, losses, schedules, engines)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from rlmega.algos import POLICY_LOSS_CONFIGS, loss_options
from rlmega.algos.rollout_correction import ROLLOUT_RS_K1_MODES, ROLLOUT_RS_MODES
from rlmega.config.verl_setting import SKIP, Refused, Rule

if TYPE_CHECKING:
    from rlmega.config.verl import VerlConfig


A, REF, RO, MODEL = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "actor_rollout_ref.model"


def _same(value: Any, verl: VerlConfig) -> Any:
    return value


def _trains_critic(verl: VerlConfig) -> bool:
    return verl("algorithm.adv_estimator") == "gae"


def _critic_only(rule: Rule) -> Rule:
    return lambda value, verl: rule(value, verl) if _trains_critic(verl) else SKIP


def _unless_null(value: Any, verl: VerlConfig) -> Any:
    return SKIP if value is None else value


def _expand(path: str) -> str:
    return os.path.expanduser(str(path))


def _files(value: Any, verl: VerlConfig) -> Any:
    if value is None:
        return SKIP
    return [_expand(path) for path in ([value] if isinstance(value, str) else value)]


def _both(rule: Rule) -> Rule:
    """The same value for two targets (the training and the validation data)."""
    def both(value: Any, verl: VerlConfig) -> Any:
        out = rule(value, verl)
        return out if out is SKIP else (out, out)
    return both


def _mini_batches(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        prompts, mini = verl("data.train_batch_size"), verl(f"{owner}.ppo_mini_batch_size")
        if not mini or prompts % mini:
            raise Refused(f"data.train_batch_size={prompts} is not a multiple of {owner}.ppo_mini_batch_size={mini}; "
                          "rlmega splits each step into equal mini-batches")
        return prompts // mini
    return rule


def _optimizer_steps_per_rl_step(owner: str, verl: VerlConfig) -> int:
    """verl steps the LR schedule once per RL step, rlmega once per optimizer step."""
    return verl(f"{owner}.ppo_epochs") * _mini_batches(owner)(None, verl)


def _warmup_steps(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        steps = verl(f"{owner}.optim.lr_warmup_steps")
        if steps is None or steps < 0:
            ratio = verl(f"{owner}.optim.lr_warmup_steps_ratio") or 0.0
            total = verl("trainer.total_training_steps")
            if ratio > 0 and not total:
                raise Refused("a warm-up ratio needs trainer.total_training_steps to become steps; set lr_warmup_steps")
            steps = int(ratio * total) if ratio > 0 else 0
        return steps * _optimizer_steps_per_rl_step(owner, verl)
    return rule


MEGATRON_SCHEDULES = {"constant": "constant", "linear": "linear", "cosine": "cosine", "WSD": "wsd"}


def _schedule(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        optim = f"{owner}.optim"
        fsdp_style = verl(f"{optim}.warmup_style") or verl(f"{optim}.lr_scheduler_type")
        if verl.is_set(f"{optim}.lr_scheduler_type") or verl(f"{optim}.warmup_style") is not None:
            if fsdp_style not in ("constant", "cosine"):
                raise Refused(f"schedule {fsdp_style!r} is not one of constant, cosine (verl's FSDP schedules)")
            if fsdp_style == "cosine" and verl(f"{optim}.num_cycles") != 0.5:
                raise Refused("rlmega's cosine schedule decays once (num_cycles=0.5)")
            return fsdp_style
        style = verl(f"{optim}.lr_decay_style")
        if style not in MEGATRON_SCHEDULES:
            raise Refused(f"lr_decay_style={style!r}: rlmega's schedules are constant, linear, cosine and WSD")
        if style == "WSD" and verl(f"{optim}.lr_wsd_decay_style") != "linear":
            raise Refused("rlmega's WSD decay phase is linear; set lr_wsd_decay_style=linear")
        return MEGATRON_SCHEDULES[style]
    return rule


def _decay_steps(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        if _schedule(owner)(None, verl) == "constant":
            return SKIP
        steps = verl(f"{owner}.optim.lr_decay_steps") or verl("trainer.total_training_steps")
        return steps * _optimizer_steps_per_rl_step(owner, verl) if steps else SKIP
    return rule


def _wsd_decay_steps(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        return SKIP if value is None else value * _optimizer_steps_per_rl_step(owner, verl)
    return rule


def _min_lr(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        optim = f"{owner}.optim"
        if verl.is_set(f"{optim}.min_lr_ratio"):
            return verl(f"{optim}.min_lr_ratio") * verl(f"{optim}.lr")
        return verl(f"{optim}.min_lr")
    return rule


def _betas(value: Any, verl: VerlConfig) -> Any:
    beta1, beta2 = value
    return float(beta1), float(beta2)


def _any_of(*keys: str) -> Rule:
    return lambda value, verl: any(bool(verl(key)) for key in keys)


DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}


def _dtype(value: Any, verl: VerlConfig) -> Any:
    if value not in DTYPES:
        raise Refused("rlmega trains in bf16 or fp32")
    return DTYPES[value]


def _sequence_parallel(value: Any, verl: VerlConfig) -> Any:
    return None if value else False  # None: rlmega's automatic choice, on when tp > 1 on GPUs, as verl's true


def _expert_tp(megatron: str) -> Rule:
    """verl passes a null expert tp to Megatron, which then uses the dense tp (rlmega's null means 1 under ep > 1)."""
    def rule(value: Any, verl: VerlConfig) -> Any:
        etp = verl(f"{megatron}.expert_tensor_parallel_size")
        return etp if etp is not None else verl(f"{megatron}.tensor_model_parallel_size")
    return rule


def _ep_and_etp(megatron: str) -> Rule:
    return lambda value, verl: (value, _expert_tp(megatron)(value, verl))


def _strategy(owner: str, verl: VerlConfig) -> Optional[str]:
    """verl's backend of a role: as the config names it, else as the engine section it writes implies."""
    if verl(f"{owner}.strategy"):
        return verl(f"{owner}.strategy")
    if verl.keys_written_under(f"{owner}.megatron"):
        return "megatron"
    return "fsdp" if verl.keys_written_under(f"{owner}.fsdp_config" if owner == A else f"{owner}.model.fsdp_config") else None


def _recompute_full(owner: str) -> Rule:
    def rule(value: Any, verl: VerlConfig) -> Any:
        return "full" if value and _strategy(owner, verl) != "megatron" else SKIP
    return rule


def _token_budget(use_dynamic: str, budget: str) -> Rule:
    return lambda value, verl: verl(budget) if verl(use_dynamic) else SKIP


def _world_size(value: Any, verl: VerlConfig) -> Any:
    return verl("trainer.nnodes") * verl("trainer.n_gpus_per_node")


ESTIMATORS = {name: name for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                      "remax", "grpo_passk", "gpg")}
ESTIMATORS.update(grpo_vectorized="grpo", rloo_vectorized="rloo")  # the same estimators, computed another way
ESTIMATORS_NOT_IN_RLMEGA = {
    "opo": "OPO's length-weighted group baseline is not in rlmega",
    "optimal_token_baseline": "the optimal-token-baseline estimator is not in rlmega",
    "tir_optimal_token_baseline": "the optimal-token-baseline estimator is not in rlmega",
}


def _estimator(value: Any, verl: VerlConfig) -> Any:
    if value in ESTIMATORS_NOT_IN_RLMEGA:
        raise Refused(ESTIMATORS_NOT_IN_RLMEGA[value])
    if value not in ESTIMATORS:
        raise Refused(f"not one of verl's estimators that rlmega has: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[value]


# verl's loss_mode -> rlmega's policy loss.
VERL_LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "sapo": "sapo", "gpg": "gpg", "clip_cov": "clip_cov",
                   "kl_cov": "kl_cov", "geo_mean": "geo_mean", "cispo": "cispo"}
# rlmega's loss options that verl has no setting for.
OPTIONS_NOT_IN_VERL = ("log_ratio_clamp",)
# verl's loss_mode -> rlmega's policy loss and the verl settings that loss reads (its config's options).
VERL_POLICY_LOSSES = {
    mode: (name, tuple(option for option in loss_options(POLICY_LOSS_CONFIGS[name]) if option not in OPTIONS_NOT_IN_VERL))
    for mode, name in VERL_LOSS_MODES.items()
}
SEQUENCE_MEAN_LOSSES = ("gspo", "sapo", "geo_mean")
"""verl averages these per sequence whatever loss_agg_mode says."""


CORRECTION = "algorithm.rollout_correction"


def _verl_loss_mode(verl: VerlConfig) -> str:
    """The loss verl trains with: in bypass mode ``loss_type`` picks it (ppo_clip: its vanilla loss; reinforce:
    its REINFORCE loss) and ``loss_mode`` is not read; otherwise ``loss_mode``."""
    if verl(f"{CORRECTION}.bypass_mode"):
        return "vanilla" if verl(f"{CORRECTION}.loss_type") == "ppo_clip" else "reinforce"
    return verl(f"{A}.policy_loss.loss_mode")


def _policy_loss(value: Any, verl: VerlConfig) -> Any:
    if value == "bypass_mode":
        raise Refused("verl picks this loss itself under algorithm.rollout_correction.bypass_mode; set that instead")
    if verl(f"{CORRECTION}.bypass_mode"):
        return SKIP  # algorithm.rollout_correction.loss_type picks the loss
    if value not in VERL_POLICY_LOSSES:
        raise Refused(f"not one of the losses rlmega has: {', '.join(VERL_POLICY_LOSSES)}")
    return VERL_POLICY_LOSSES[value][0]


def _loss_parameter(parameter: str) -> Rule:
    """A loss parameter, set only for a loss that reads it (rlmega refuses parameters a loss does not take)."""
    def rule(value: Any, verl: VerlConfig) -> Any:
        mode = _verl_loss_mode(verl)
        if parameter not in VERL_POLICY_LOSSES.get(mode, ("", ()))[1]:
            return SKIP
        if parameter in ("clip_ratio_low", "clip_ratio_high"):
            own = verl(f"{A}.{parameter}")
            return own if own is not None else verl(f"{A}.clip_ratio")
        owner = A if parameter in ("clip_ratio_c", "tau_pos", "tau_neg") else f"{A}.policy_loss"
        return verl(f"{owner}.{parameter}")
    return rule


def _clip_ratio(value: Any, verl: VerlConfig) -> Any:
    low, high = _loss_parameter("clip_ratio_low")(value, verl), _loss_parameter("clip_ratio_high")(value, verl)
    return SKIP if low is SKIP else (low, high)


def _loss_agg_mode(value: Any, verl: VerlConfig) -> Any:
    return "seq-mean-token-mean" if _verl_loss_mode(verl) in SEQUENCE_MEAN_LOSSES else value


def _bypass_loss(value: Any, verl: VerlConfig) -> Any:
    if not verl(f"{CORRECTION}.bypass_mode"):
        return SKIP  # only read in bypass mode
    if value == "ppo_clip":
        return VERL_LOSS_MODES["vanilla"]
    if value == "reinforce":
        return "reinforce"
    raise Refused("verl's bypass mode takes loss_type ppo_clip or reinforce")


def _norm_horizon(value: Any, verl: VerlConfig) -> Any:
    if _loss_agg_mode(verl(f"{A}.loss_agg_mode"), verl) != "seq-mean-token-sum-norm":
        return SKIP
    return value if value is not None else verl(f"{RO}.response_length")


def _kl_loss_coef(value: Any, verl: VerlConfig) -> Any:
    return float(verl(f"{A}.kl_loss_coef")) if verl(f"{A}.use_kl_loss") else 0.0


def _kl_in_reward_coef(value: Any, verl: VerlConfig) -> Any:
    return float(verl("algorithm.kl_ctrl.kl_coef")) if verl("algorithm.use_kl_in_reward") else 0.0


def _kl_estimator(value: Any, verl: VerlConfig) -> Any:
    from rlmega.algos import KL_ESTIMATORS

    in_loss, in_reward = verl(f"{A}.use_kl_loss"), verl("algorithm.use_kl_in_reward")
    loss_type, penalty = verl(f"{A}.kl_loss_type"), verl("algorithm.kl_penalty")
    if in_loss and in_reward and loss_type != penalty:
        raise Refused(f"{A}.kl_loss_type={loss_type} and algorithm.kl_penalty={penalty} differ; rlmega has one KL "
                      "estimator (actor.policy_loss.kl_estimator) for the loss and the reward")
    name = penalty if in_reward and not in_loss else loss_type
    if str(name).endswith("+"):
        raise Refused(f"{name}: straight-through KL gradients ('+') are not in rlmega")
    if name not in KL_ESTIMATORS:
        raise Refused(f"{name!r} is not one of rlmega's KL estimators {', '.join(KL_ESTIMATORS)}")
    return name


def _top_k(value: Any, verl: VerlConfig) -> Any:
    return None if value in (None, -1, 0) else int(value)


def _temperature(prefix: str) -> Rule:
    return lambda value, verl: float(verl(f"{prefix}.temperature")) if verl(f"{prefix}.do_sample") else 0.0


def _val_temperature(value: Any, verl: VerlConfig) -> Any:
    return _temperature(f"{RO}.val_kwargs")(value, verl)


def _val_filter(name: str, normalise: Callable[[Any], Any]) -> Rule:
    """A sampled validation's top_p or top_k: its own value when it differs from training's, else null (rlmega
    then validates with the training value); a greedy validation filters nothing (SKIP)."""
    def rule(value: Any, verl: VerlConfig) -> Any:
        if not _val_temperature(None, verl):
            return SKIP
        validation = normalise(verl(f"{RO}.val_kwargs.{name}"))
        return None if validation == normalise(verl(f"{RO}.{name}")) else validation
    return rule


def _val_top_k(value: Any) -> int:
    return 0 if value in (None, -1, 0) else int(value)  # rlmega's 0 is no top-k; null follows training


BACKENDS = {"vllm": "vllm", "sglang": "sglang", "hf": "hf"}


def _backend(value: Any, verl: VerlConfig) -> Any:
    if value is None:
        return SKIP
    if value not in BACKENDS:
        raise Refused("rlmega's engines are hf, vllm and sglang")
    return BACKENDS[value]


def _engine_kwargs(backend: str) -> Rule:
    return lambda value, verl: dict(value or {}) if verl(f"{RO}.name") == backend else SKIP


LOGGERS = {"console": "console", "wandb": "wandb", "tracking": "wandb", "mlflow": "mlflow",
           "tensorboard": "tensorboard", "file": "jsonl"}


def _loggers(value: Any, verl: VerlConfig) -> Any:
    names = [value] if isinstance(value, str) else list(value or [])
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise Refused(f"{', '.join(unknown)}: rlmega logs to console, jsonl (verl's file), wandb, mlflow and tensorboard")
    return list(dict.fromkeys(LOGGERS[name] for name in names))


def _every(value: Any, verl: VerlConfig) -> Any:
    return max(int(value), 0)  # verl's -1 (never) is rlmega's 0


def _resume(value: Any, verl: VerlConfig) -> Any:
    if value == "auto":
        return "auto"
    if value == "disable":
        return "never"
    raise Refused("rlmega resumes from run_dir's latest checkpoint (auto) or not at all (disable); "
                  "point run_dir at the run to resume")


def _saved_contents(value: Any, verl: VerlConfig) -> Any:
    contents = set(value or ())
    if not {"model", "optimizer"} <= contents:
        raise Refused("rlmega's checkpoints always hold the model and the optimizer, so a run resumes exactly")
    return True if "hf_model" in contents else SKIP


def _overlong_buffer(value: Any, verl: VerlConfig) -> Any:
    return int(verl("reward_model.overlong_buffer.len")) if verl("reward_model.overlong_buffer.enable") else 0


def _overlong_penalty(value: Any, verl: VerlConfig) -> Any:
    return float(value) if verl("reward_model.overlong_buffer.enable") else SKIP


def _generation_rounds(value: Any, verl: VerlConfig) -> Any:
    if not verl("algorithm.filter_groups.enable"):
        return SKIP
    batches = verl("algorithm.filter_groups.max_num_gen_batches")
    if not batches or batches <= 0:
        raise Refused("rlmega's dynamic sampling needs a round limit; set algorithm.filter_groups.max_num_gen_batches > 0")
    return math.ceil(batches * verl("data.gen_batch_size") / verl("data.train_batch_size"))


def _filter_metric(value: Any, verl: VerlConfig) -> Any:
    if not verl("algorithm.filter_groups.enable") or value is None:
        return SKIP
    if value == "seq_final_reward" and verl("algorithm.use_kl_in_reward"):
        raise Refused("rlmega filters groups before the reference's KL is known; filter on seq_reward (the score "
                      "without the KL penalty) instead")
    return "shaped_score" if value in ("seq_reward", "seq_final_reward") else value


def _rollout_is(value: Any, verl: VerlConfig) -> Any:
    if value not in (None, "token", "sequence"):
        raise Refused("rlmega's IS weights are per token or per sequence (token, sequence, null)")
    return value


RS_STATISTICS_NOT_IN_RLMEGA = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                               "seq_max_k2", "seq_max_k3")


def _rollout_rs(value: Any, verl: VerlConfig) -> Any:
    if isinstance(value, str) and "," in value:
        raise Refused("rlmega rejects by one criterion; verl's comma-separated chains of rollout_rs options are not in "
                      "rlmega: keep one of them")
    if value in RS_STATISTICS_NOT_IN_RLMEGA:
        raise Refused("verl's k2/k3 divergence statistics are not in rlmega; use token_k1, seq_sum_k1 or seq_mean_k1 "
                      "(or verl 0.7.0's token, sequence, geometric)")
    if value is not None and value not in ROLLOUT_RS_MODES:
        raise Refused(f"not one of verl's rejection options rlmega has: {', '.join(ROLLOUT_RS_MODES)} or null")
    return value


def _rs_threshold(value: Any, verl: VerlConfig) -> Any:
    """verl's threshold -> (rlmega's upper bound, its lower bound): a number is the upper bound (the lower one is then
    rollout_rs_threshold_lower's, by default 1/upper as in both verls); verl's 'lower_upper' string gives both.
    Without rollout_rs verl does not read it."""
    if verl(f"{CORRECTION}.rollout_rs") is None:
        return SKIP, SKIP
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value, SKIP
    if not isinstance(value, str) or "," in value:
        raise Refused("rlmega rejects by one criterion, so one threshold: a number or 'lower_upper'")
    lower, _, upper = value.rpartition("_")
    try:
        bounds = float(lower) if lower else None, float(upper)
    except ValueError:
        raise Refused("a number, or 'lower_upper' with two numbers (e.g. 0.5_2.0)") from None
    if bounds[0] is None:
        return bounds[1], SKIP
    if verl(f"{CORRECTION}.rollout_rs") not in ROLLOUT_RS_K1_MODES:
        raise Refused("verl reads a 'lower_upper' band only with its k1 options (token_k1, seq_sum_k1, seq_mean_k1); "
                      "for token, sequence or geometric set rollout_rs_threshold_lower")
    return bounds[1], bounds[0]


def _truncation(value: Any, verl: VerlConfig) -> Any:
    if value not in ("error", "left", "right"):
        raise Refused("rlmega truncates left or right, or stops (error)")
    return value


def _user_function(value: Any, verl: VerlConfig) -> Any:
    path = verl("custom_reward_function.path")
    return SKIP if not path else f"{_expand(path)}:{verl('custom_reward_function.name')}"


REWARD_MANAGERS = ("naive", "prime", "dapo")


def _reward_manager(value: Any, verl: VerlConfig) -> bool:
    return value in REWARD_MANAGERS


def _critic_warmup(value: Any, verl: VerlConfig) -> Any:
    return max(int(value) - 1, 0)


def _after_training_steps(value: Any, verl: VerlConfig) -> Any:
    return SKIP if verl("trainer.total_training_steps") is not None else value


def _bucket_bytes(value: Any, verl: VerlConfig) -> Any:
    return int(value) * 1024**2


def _quantization(value: Any, verl: VerlConfig) -> Any:
    """verl's rollout quantization: only blockwise fp8 (DeepSeek-V3's format) is rlmega's too."""
    if value is None:
        return SKIP
    if str(value).lower() != "fp8":
        raise Refused(f"rollout.quantization={value}: rlmega's engines serve fp8 (rollout.weight_dtype=fp8) or the "
                      "trained weights as they are")
    return "fp8"

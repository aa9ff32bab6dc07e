"""verl's PPO/GRPO trainer settings, one table: ``VERL_SETTINGS`` maps every key of verl's
documented trainer config to the rlmega field it becomes (with a rule where the value changes), or
says why rlmega has none (see ``rlmega.config.verl`` for the kinds and the translation)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from rlmega.algos import POLICY_LOSS_CONFIGS, loss_options

if TYPE_CHECKING:
    from rlmega.config.verl import VerlConfig


class VerlTranslationError(ValueError):
    """A verl setting that cannot cross over: one line naming the verl key and the reason."""


class Refused(Exception):
    """Raised by a rule: this verl value has no rlmega equivalent (the message says why)."""


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()
"""A rule's answer when the value does not reach rlmega (e.g. a critic setting in a run without a critic)."""

Rule = Callable[[Any, "VerlConfig"], Any]


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one verl key crosses over."""

    default: Any
    """verl's default as verl writes it (an interpolation where verl's default follows another key)."""
    targets: tuple[str, ...] = ()
    """The rlmega fields (dotted) the value goes to; empty: none."""
    rule: Optional[Rule] = None
    """``(value, verl) -> value for the targets`` (a tuple for several), SKIP, or ``raise Refused``;
    None: the value as it is."""
    note: str = ""
    """Mapped: how the value changes, where it does. Otherwise: why rlmega has no field."""
    refused: bool = False
    """A value other than verl's default (or null/empty) stops the translation."""
    accept: Optional[Callable[[Any, "VerlConfig"], bool]] = None
    """The values of a refused key that rlmega honours anyway."""
    carry: bool = False
    """Translate verl's default too, not only a value the config sets: for what is trained (algorithm,
    sampling, batch sizes, optimizer, loss), where rlmega's default may differ from verl's."""

    @property
    def kind(self) -> str:
        if self.targets:
            return "mapped"
        return "refused" if self.refused else "not needed"


def trained(*targets: str, default: Any, rule: Optional[Rule] = None, note: str = "") -> Setting:
    """A mapped key whose verl default is carried over."""
    return Setting(default, targets, rule, note, carry=True)


def mapped(*targets: str, default: Any, rule: Optional[Rule] = None, note: str = "") -> Setting:
    """A mapped key that is translated only when the config sets it."""
    return Setting(default, targets, rule, note)


def needless(reason: str, default: Any = None) -> Setting:
    return Setting(default, note=reason)


def refused(reason: str, default: Any = None, accept: Optional[Callable[[Any, "VerlConfig"], bool]] = None) -> Setting:
    return Setting(default, note=reason, refused=True, accept=accept)


# ---------------------------------------------------------------------------------------------- rules

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


def _policy_loss(value: Any, verl: VerlConfig) -> Any:
    if value == "bypass_mode":
        raise Refused("verl picks this loss itself under algorithm.rollout_correction.bypass_mode; set that instead")
    if value not in VERL_POLICY_LOSSES:
        raise Refused(f"not one of the losses rlmega has: {', '.join(VERL_POLICY_LOSSES)}")
    return VERL_POLICY_LOSSES[value][0]


def _loss_parameter(parameter: str) -> Rule:
    """A loss parameter, set only for a loss that reads it (rlmega refuses parameters a loss does not take)."""
    def rule(value: Any, verl: VerlConfig) -> Any:
        mode = verl(f"{A}.policy_loss.loss_mode")
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
    return "seq-mean-token-mean" if verl(f"{A}.policy_loss.loss_mode") in SEQUENCE_MEAN_LOSSES else value


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
    """rlmega validates with the training top_p and top_k, so a sampled validation must use them too."""
    temperature = _temperature(f"{RO}.val_kwargs")(value, verl)
    if temperature:
        for name, normalise in (("top_p", float), ("top_k", lambda v: _top_k(v, verl))):
            validation, training = verl(f"{RO}.val_kwargs.{name}"), verl(f"{RO}.{name}")
            if normalise(validation) != normalise(training):
                raise Refused(f"validation samples with val_kwargs.{name}={validation} but training with {name}="
                              f"{training}; rlmega validates with rollout.{name}")
    return temperature


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


def _filter_metric(value: Any, verl: VerlConfig) -> bool:
    return (not verl("algorithm.filter_groups.enable") or value in (None, "seq_reward")
            or (value == "seq_final_reward" and not verl("algorithm.use_kl_in_reward")))


def _rollout_is(value: Any, verl: VerlConfig) -> Any:
    if value not in (None, "token", "sequence"):
        raise Refused("rlmega's IS weights are per token or per sequence (token, sequence, null)")
    return value


def _rollout_rs(value: Any, verl: VerlConfig) -> Any:
    if value not in (None, "token", "sequence", "geometric"):
        raise Refused("rlmega rejects on the ratio per token, sequence or geometric mean (token, sequence, geometric, "
                      "null); verl's k1/k2/k3 rejection statistics are not in rlmega")
    return value


def _rs_threshold(value: Any, verl: VerlConfig) -> Any:
    if value is not None and not isinstance(value, (int, float)):
        raise Refused("rlmega takes the upper bound as a number and the lower one as rollout_rs_threshold_lower")
    return value


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


# ---------------------------------------------------------------------------------------------- reasons

MICRO_BATCH = ("micro-batch size in sequences; rlmega forms micro-batches by a token budget "
               "(batching.max_tokens_per_microbatch) and the loss does not depend on the split")
FSDP = "an FSDP sharding setting; rlmega trains with Megatron-Core"
KERNELS = "a kernel or compile choice; it changes speed, not what is trained"
MEMORY = "saves memory only; rlmega bounds memory by its token budget and recomputation"
ENGINE = "an engine tuning knob; rlmega leaves it at the engine's default (rollout.engine_kwargs takes engine arguments)"
NO_LORA = "rlmega trains every weight; LoRA adapters are not in rlmega"
CONFIG_AS_IS = "rlmega builds the model from its config.json as it is"
SHUFFLE = "rlmega keeps each step's responses in order when it splits them into mini-batches"
PROFILING = "per-role profiling is not in rlmega; run the job under nsys or torch.profiler"
ROUTER_REPLAY = "the reference model routes by itself in rlmega"
LOAD_WEIGHT = "rlmega always starts from the weights in model.path"


def _profiler(prefix: str, enable_default: Any = False) -> dict[str, Setting]:
    return {
        f"{prefix}.profiler.enable": refused(PROFILING, enable_default),
        f"{prefix}.profiler.*": needless("only read with profiler.enable, which is refused"),
    }


def _router_replay_mode(value: Any, verl: "VerlConfig") -> str:
    mode = str(value).lower()
    if mode == "disabled":
        return "none"
    if mode in ("r2", "r3"):
        return mode
    raise ValueError(f"router_replay.mode={value}: choose disabled, R2 or R3")


def _router_replay(prefix: str, role: str) -> dict[str, Setting]:
    if role == "ref":  # the reference scores with its own routing
        return {
            f"{prefix}.router_replay.mode": refused(ROUTER_REPLAY, "disabled"),
            f"{prefix}.router_replay.*": needless("only read with router_replay.mode, which is refused"),
        }
    return {
        f"{prefix}.router_replay.mode": mapped(f"{role}.router_replay", default="disabled", rule=_router_replay_mode,
                                               note="disabled -> none, R2 -> r2, R3 -> r3 (the engines record routing)"),
        f"{prefix}.router_replay.*": needless("recording and replay are rlmega's own (rlmega/workers/routing.py)"),
    }


def _optimizer(owner: str, role: str, lr: float) -> dict[str, Setting]:
    """``{owner}.optim`` (Megatron and FSDP spellings) -> ``{role}.optimizer``."""
    gate = _critic_only if role == "critic" else (lambda rule: rule)
    optim, target = f"{owner}.optim", f"{role}.optimizer"
    per_step = ("verl counts LR steps per RL step, rlmega per optimizer step: the steps are multiplied by "
                f"{owner}.ppo_epochs * ppo_mini_batches")
    schedule = trained(f"{target}.lr_schedule", default="constant", rule=gate(_schedule(owner)),
                       note="constant, linear, cosine, WSD (wsd, linear decay only); FSDP's constant, cosine")
    return {
        f"{optim}.lr": trained(f"{target}.lr", default=lr, rule=gate(_same)),
        f"{optim}.lr_warmup_steps": trained(f"{target}.lr_warmup_steps", default=-1, rule=gate(_warmup_steps(owner)),
                                            note=f"-1 uses lr_warmup_steps_ratio; {per_step}"),
        f"{optim}.lr_warmup_steps_ratio": trained(f"{target}.lr_warmup_steps", default=0.0,
                                                  rule=gate(_warmup_steps(owner)),
                                                  note="times trainer.total_training_steps, which it then needs"),
        f"{optim}.total_training_steps": needless("verl fills it in at run time from the trainer's step count", -1),
        f"{optim}.weight_decay": trained(f"{target}.weight_decay", default=0.01, rule=gate(_same)),
        f"{optim}.betas": trained(f"{target}.adam_beta1", f"{target}.adam_beta2", default=[0.9, 0.999],
                                  rule=gate(_betas)),
        f"{optim}.clip_grad": trained(f"{target}.clip_grad", default=1.0, rule=gate(_same)),
        f"{optim}.optimizer": refused("rlmega trains with Megatron's Adam (decoupled weight decay, i.e. AdamW)", "adam",
                                      accept=lambda value, verl: str(value).lower() in ("adam", "adamw")),
        f"{optim}.optimizer_impl": refused("rlmega uses Megatron's optimizer, not a torch.optim class",
                                           "torch.optim", accept=lambda value, verl: value == "torch.optim"),
        f"{optim}.lr_warmup_init": refused("rlmega's warm-up starts from 0", 0.0),
        f"{optim}.lr_decay_steps": trained(f"{target}.lr_decay_steps", default=None, rule=gate(_decay_steps(owner)),
                                           note=f"null decays over trainer.total_training_steps; {per_step}"),
        f"{optim}.lr_decay_style": schedule,
        f"{optim}.lr_scheduler_type": schedule,
        f"{optim}.warmup_style": dataclasses.replace(schedule, default=None, note="older spelling of lr_scheduler_type"),
        f"{optim}.num_cycles": dataclasses.replace(schedule, default=0.5, note="only 0.5 (one half-cosine)"),
        f"{optim}.lr_wsd_decay_style": dataclasses.replace(schedule, default="exponential", note="only linear"),
        f"{optim}.lr_wsd_decay_steps": trained(f"{target}.wsd_decay_steps", default=None,
                                               rule=gate(_wsd_decay_steps(owner)), note=per_step),
        f"{optim}.min_lr": trained(f"{target}.min_lr", default=0.0, rule=gate(_min_lr(owner))),
        f"{optim}.min_lr_ratio": trained(f"{target}.min_lr", default=0.0, rule=gate(_min_lr(owner)),
                                         note="times lr"),
        f"{optim}.weight_decay_incr_style": refused("rlmega keeps the weight decay constant", "constant"),
        f"{optim}.use_checkpoint_opt_param_scheduler": needless(
            "rlmega's checkpoints always hold the LR schedule's state", False),
        f"{optim}.override_optimizer_config": refused("rlmega's optimizer takes only the fields of actor.optimizer", {}),
    }


def _megatron(owner: str, role: str) -> dict[str, Setting]:
    """``{owner}.megatron``: the engine settings of one role."""
    gate = _critic_only if role == "critic" else (lambda rule: rule)
    megatron = f"{owner}.megatron"
    follows = role == "ref"  # verl's reference follows the actor's engine settings by default

    def default(name: str, value: Any) -> Any:
        return f"${{oc.select:{A}.megatron.{name},{'null' if value is None else value}}}" if follows else value

    parallel = {
        "tensor_model_parallel_size": ("layout.tp", 1), "pipeline_model_parallel_size": ("layout.pp", 1),
        "virtual_pipeline_model_parallel_size": ("layout.vpp", None), "context_parallel_size": ("layout.cp", 1),
        "expert_tensor_parallel_size": ("layout.etp", None),
    }
    one_layout = "; one layout for all roles: a value other than the actor's is refused" if role != "actor" else ""
    table = {f"{megatron}.{name}": mapped(target, default=default(name, value), rule=gate(_same),
                                          note=one_layout.removeprefix("; "))
             for name, (target, value) in parallel.items()}
    table[f"{megatron}.expert_tensor_parallel_size"] = mapped(
        "layout.etp", default=default("expert_tensor_parallel_size", None), rule=gate(_expert_tp(megatron)),
        note="null becomes the dense tp, as Megatron reads verl's null" + one_layout)
    table[f"{megatron}.expert_model_parallel_size"] = mapped(
        "layout.ep", "layout.etp", default=default("expert_model_parallel_size", 1), rule=gate(_ep_and_etp(megatron)),
        note="with the expert tp verl's null implies" + one_layout)
    offload_keys = [f"{megatron}.{name}" for name in ("param_offload", "grad_offload", "optimizer_offload")]
    if role == "ref":
        table[f"{megatron}.param_offload"] = mapped(
            "ref.offload", default=default("param_offload", False),
            rule=_any_of(f"{megatron}.param_offload", f"{REF}.fsdp_config.param_offload"),
            note="rlmega's reference offloads by default; verl's default is not carried")
        no_grads = "the reference has no gradients or optimizer state"
        table[f"{megatron}.grad_offload"] = needless(no_grads, False)
        table[f"{megatron}.optimizer_offload"] = needless(no_grads, False)
    else:
        fsdp = f"{owner}.fsdp_config" if role == "actor" else f"{owner}.model.fsdp_config"
        offload = gate(_any_of(*offload_keys, f"{fsdp}.param_offload", f"{fsdp}.optimizer_offload"))
        for key in offload_keys:
            table[key] = mapped(f"{role}.offload", default=False, rule=offload,
                                note="rlmega offloads parameters, gradients and optimizer state together")
    transformer = f"{megatron}.override_transformer_config"
    table.update({
        f"{megatron}.sequence_parallel": mapped(f"{role}.sequence_parallel", default=True, rule=gate(_sequence_parallel),
                                                note="true becomes null (on when tp > 1 on GPUs, as in verl)"),
        f"{megatron}.use_distributed_optimizer": (
            needless("the reference has no optimizer", True) if role == "ref" else
            mapped(f"{role}.optimizer.distributed_optimizer", default=True, rule=gate(_same))),
        f"{megatron}.use_dist_checkpointing": refused(
            "rlmega starts from HF weights (model.path); convert a Megatron checkpoint with converters/ first", False),
        f"{megatron}.dist_checkpointing_path": needless("only read with use_dist_checkpointing, which is refused"),
        f"{megatron}.dist_checkpointing_prefix": needless("only read with use_dist_checkpointing, which is refused", ""),
        f"{megatron}.seed": needless("rlmega seeds Megatron's random streams from trainer.seed", default("seed", 42)),
        f"{megatron}.override_ddp_config": refused("rlmega configures Megatron's DDP itself", {}),
        f"{megatron}.override_mcore_model_config": refused(CONFIG_AS_IS, {}),
        f"{megatron}.use_mbridge": needless("rlmega converts HF weights with its own bridge",
                                            default("use_mbridge", "False") if follows else True),
        f"{megatron}.vanilla_mbridge": needless("rlmega converts HF weights with its own bridge",
                                                default("vanilla_mbridge", "True") if follows else True),
        f"{megatron}.use_remove_padding": needless("rlmega packs sequences itself (batching.packing)",
                                                   default("use_remove_padding", "True") if follows else True),
        f"{megatron}.forward_only": needless("set by verl per role", role == "ref"),
        f"{megatron}.dtype": mapped(f"{role}.dtype", default="bfloat16", rule=gate(_dtype),
                                    note="bfloat16 becomes bf16, float32 fp32"),
    })
    if follows:
        table[transformer] = refused(
            "rlmega builds the reference from the actor's model config; only recompute and speed settings may "
            "differ",
            f"${{oc.select:{A}.megatron.override_transformer_config,{{}}}}", accept=_only_recompute_differs)
        return table
    recompute = {"recompute_granularity": "full or selective", "recompute_method": "uniform or block",
                 "recompute_num_layers": "", "recompute_modules": "selective only"}
    for name, note in recompute.items():
        table[f"{transformer}.{name}"] = mapped(f"{role}.{name}", default=None, rule=gate(_same), note=note)
    stages = {"num_layers_in_first_pipeline_stage": "layout.first_stage_layers",
              "num_layers_in_last_pipeline_stage": "layout.last_stage_layers"}
    for name, target in stages.items():
        table[f"{transformer}.{name}"] = mapped(target, default=None, rule=gate(_same),
                                                note="uneven pipeline stages" + one_layout)
    for name in TRANSFORMER_SPEED_SWITCHES:
        table[f"{transformer}.{name}"] = needless(KERNELS)
    table.update({
        f"{transformer}.attention_backend": needless("rlmega picks the attention kernels", "flash"),
        f"{transformer}.*": refused(CONFIG_AS_IS),
    })
    return table


# Megatron TransformerConfig switches verl configs commonly set that change kernels or communication only.
TRANSFORMER_SPEED_SWITCHES = (
    "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "gradient_accumulation_fusion", "persist_layer_norm", "deallocate_pipeline_outputs", "moe_permute_fusion",
    "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_enable_deepep", "moe_shared_expert_overlap",
)


def _only_recompute_differs(value: Any, verl: VerlConfig) -> bool:
    free = (*TRANSFORMER_SPEED_SWITCHES, "attention_backend")

    def others(config: Any) -> dict:
        return {key: item for key, item in (config or {}).items()
                if not str(key).startswith("recompute_") and key not in free}
    actor = f"{A}.megatron.override_transformer_config"
    return others(value) == others({name.rpartition(".")[2]: verl(name) for name in verl.keys_under(actor)})


def _fsdp(fsdp: str, role: str) -> dict[str, Setting]:
    """``{fsdp}`` (an ``fsdp_config`` section): mostly sharding settings that do not apply."""
    gate = _critic_only if role == "critic" else (lambda rule: rule)
    owner = fsdp.rpartition(".model")[0] if role == "critic" else fsdp.rpartition(".")[0]
    table = {f"{fsdp}.{name}": needless(FSDP, value) for name, value in (
        ("offload_policy", False), ("reshard_after_forward", True), ("fsdp_size", -1), ("forward_prefetch", False),
        ("use_orig_params", False))}
    table.update({
        f"{fsdp}.wrap_policy.*": needless(FSDP),
        f"{fsdp}.model_dtype": needless("FSDP's parameter dtype; rlmega keeps fp32 master weights in its optimizer", "fp32"),
        f"{fsdp}.seed": needless("rlmega seeds from trainer.seed", 42),
        f"{fsdp}.full_determinism": refused("bitwise-deterministic kernels are not an rlmega switch", False),
        f"{fsdp}.ulysses_sequence_parallel_size": mapped("layout.cp", default=1, rule=gate(_same),
                                                         note="context parallelism splits each sequence as Ulysses does"),
        f"{fsdp}.entropy_from_logits_with_chunking": needless(MEMORY, False),
        f"{fsdp}.entropy_checkpointing": needless(MEMORY, False),
        f"{fsdp}.use_torch_compile": needless(KERNELS, True),
        f"{fsdp}.forward_only": needless("set by verl per role", role == "ref"),
        f"{fsdp}.strategy": needless("verl's backend name; rlmega trains with Megatron-Core", "fsdp"),
        f"{fsdp}.dtype": mapped(f"{role}.dtype", default="bfloat16", rule=gate(_dtype),
                                note="bfloat16 becomes bf16, float32 fp32"),
    })
    if role == "ref":
        table[f"{fsdp}.param_offload"] = mapped("ref.offload", default=False,
                                                rule=_any_of(f"{REF}.megatron.param_offload", f"{fsdp}.param_offload"))
        table[f"{fsdp}.optimizer_offload"] = needless("the reference has no optimizer state", False)
    else:
        offload = gate(_any_of(f"{owner}.megatron.param_offload", f"{owner}.megatron.grad_offload",
                               f"{owner}.megatron.optimizer_offload", f"{fsdp}.param_offload", f"{fsdp}.optimizer_offload"))
        for name in ("param_offload", "optimizer_offload"):
            table[f"{fsdp}.{name}"] = mapped(f"{role}.offload", default=False, rule=offload,
                                             note="rlmega offloads parameters, gradients and optimizer state together")
    return table


def _model_overrides(model: str, role: str) -> dict[str, Setting]:
    gate = _critic_only if role == "critic" else (lambda rule: rule)
    return {
        f"{model}.override_config.model_config": refused(CONFIG_AS_IS, {}),
        f"{model}.override_config.moe_config.freeze_moe_router": mapped(f"{role}.freeze_moe_router", default=False,
                                                                        rule=gate(_same)),
        f"{model}.override_config.attn_implementation": needless("an HF attention choice; rlmega picks Megatron's kernels"),
        f"{model}.override_config.*": refused(CONFIG_AS_IS),
    }


def _megatron_lora(model: str) -> dict[str, Setting]:
    return {
        f"{model}.lora.rank": refused(NO_LORA, 0),
        f"{model}.lora.*": needless("only read with lora.rank > 0, which is refused"),
    }


def _fsdp_lora(model: str) -> dict[str, Setting]:
    only = needless("only read with lora_rank > 0, which is refused")
    table = {f"{model}.lora_rank": refused(NO_LORA, 0)}
    table.update({f"{model}.{name}": dataclasses.replace(only, default=value) for name, value in (
        ("lora_alpha", 16), ("target_modules", "all-linear"), ("exclude_modules", None), ("lora_adapter_path", None))})
    return table


# ---------------------------------------------------------------------------------------------- the table

VERL_SETTINGS: dict[str, Setting] = {
    # --------------------------------------------------------------------------------------- data
    "data.tokenizer": mapped("model.tokenizer_path", default=None, rule=_unless_null,
                             note="rlmega has one tokenizer for the data and the model"),
    "data.use_shm": needless("copies files to /dev/shm to load them faster", False),
    "data.train_files": mapped("data.files", default="~/data/rlhf/gsm8k/train.parquet", rule=_files,
                               note="a single file becomes a list; ~ is expanded"),
    "data.val_files": mapped("val_data.files", default="~/data/rlhf/gsm8k/test.parquet", rule=_files,
                             note="a single file becomes a list; ~ is expanded"),
    "data.train_max_samples": refused("rlmega trains on every row of data.files; shorten the files instead", -1,
                                      accept=lambda value, verl: value < 0),
    "data.val_max_samples": mapped("trainer.val_prompts", default=-1,
                                   rule=lambda value, verl: value if value and value > 0 else SKIP,
                                   note="-1 (every row) leaves trainer.val_prompts as it is"),
    "data.prompt_key": trained("data.prompt_key", "val_data.prompt_key", default="prompt", rule=_both(_same)),
    "data.reward_fn_key": refused("rlmega picks each row's scorer by its data_source column", "data_source"),
    "data.max_prompt_length": trained("data.max_prompt_length", "val_data.max_prompt_length", default=512,
                                      rule=_both(_same)),
    "data.max_response_length": trained("rollout.max_new_tokens", default=512,
                                        rule=lambda value, verl: verl(f"{RO}.response_length"),
                                        note=f"through {RO}.response_length, which follows it by default"),
    "data.train_batch_size": trained("trainer.prompts_per_step", default=1024, note="prompts per step in both"),
    "data.val_batch_size": needless("rlmega batches validation prompts itself"),
    "data.gen_batch_size": trained("algorithm.max_generation_rounds", default="${data.train_batch_size}",
                                   rule=_generation_rounds,
                                   note="DAPO: rlmega generates rounds of trainer.prompts_per_step prompts, so the "
                                        "round limit keeps verl's prompt budget"),
    "data.tool_config_path": refused("verl's tool config files do not translate: list the tools in rlmega's "
                                     "agent.tools (rlmega/agent/README.md)",
                                     f"${{oc.select:{RO}.multi_turn.tool_config_path, null}}"),
    "data.return_raw_input_ids": needless("only for a reward model with its own tokenizer, which rlmega does not run",
                                          False),
    "data.return_raw_chat": needless("rlmega keeps each row's messages", True),
    "data.return_full_prompt": needless("changes what verl keeps for logging only", False),
    "data.shuffle": refused("rlmega always shuffles the training prompts (seeded by trainer.seed)", True),
    "data.seed": mapped("trainer.seed", default=None, rule=_unless_null,
                        note="rlmega's one seed; verl's sample order is not reproduced"),
    "data.dataloader_num_workers": needless("rlmega tokenizes every prompt once at start", 8),
    "data.image_patch_size": needless("multimodal input; rlmega trains text-only models", 14),
    "data.validation_shuffle": needless("rlmega validates on the first trainer.val_prompts rows in file order", False),
    "data.filter_overlong_prompts": trained("data.filter_overlong_prompts", "val_data.filter_overlong_prompts",
                                            default=False, rule=_both(_same)),
    "data.filter_overlong_prompts_workers": needless("rlmega filters while it tokenizes", 1),
    "data.truncation": trained("data.truncation", "val_data.truncation", default="error", rule=_both(_truncation),
                               note="middle is refused"),
    "data.image_key": needless("multimodal input; rlmega trains text-only models", "images"),
    "data.video_key": needless("multimodal input; rlmega trains text-only models", "videos"),
    "data.trust_remote_code": refused("rlmega loads tokenizers without remote code", False),
    "data.custom_cls.path": refused("rlmega reads parquet/jsonl rows with its own schema (rlmega/data)"),
    "data.custom_cls.name": needless("only read with data.custom_cls.path, which is refused"),
    "data.return_multi_modal_inputs": needless("multimodal input; rlmega trains text-only models", True),
    "data.sampler.class_path": refused("curriculum samplers are not in rlmega; it draws prompts evenly per epoch"),
    "data.sampler.class_name": needless("only read with data.sampler.class_path, which is refused"),
    "data.datagen.path": refused("generating data during training is not in rlmega"),
    "data.datagen.name": needless("only read with data.datagen.path, which is refused"),
    "data.apply_chat_template_kwargs": trained("data.chat_template_kwargs", "val_data.chat_template_kwargs", default={},
                                               rule=_both(lambda value, verl: dict(value or {}))),
    # ---------------------------------------------------------------------------- actor_rollout_ref
    "actor_rollout_ref.hybrid_engine": mapped("rollout.placement", default=True,
                                              rule=lambda value, verl: "colocated" if value else "disaggregated",
                                              note="true: colocated; false: disaggregated"),
    "actor_rollout_ref.nccl_timeout": needless("rlmega's waits follow cluster.timeout_s", 600),
    # model
    f"{MODEL}.path": mapped("model.path", default="~/models/deepseek-llm-7b-chat",
                            rule=lambda value, verl: _expand(value), note="~ is expanded"),
    f"{MODEL}.hf_config_path": refused("rlmega reads config.json from model.path"),
    f"{MODEL}.tokenizer_path": mapped("model.tokenizer_path", default=None, rule=_unless_null),
    f"{MODEL}.use_shm": needless("copies the model to /dev/shm to load it faster", False),
    f"{MODEL}.trust_remote_code": refused("rlmega builds the architectures it supports and loads tokenizers without "
                                          "remote code", False),
    f"{MODEL}.custom_chat_template": refused("rlmega uses the tokenizer's chat template; put the template in the "
                                             "tokenizer's files"),
    f"{MODEL}.external_lib": refused("rlmega builds only the architectures it supports (rlmega/models)"),
    **_model_overrides(MODEL, "actor"),
    f"{MODEL}.enable_gradient_checkpointing": mapped(
        "actor.recompute_granularity", default=True, rule=_recompute_full(A),
        note="FSDP only in verl: true becomes full recomputation; megatron configs use "
             "override_transformer_config.recompute_*"),
    f"{MODEL}.enable_activation_offload": needless(MEMORY, False),
    f"{MODEL}.use_remove_padding": needless("rlmega packs sequences itself (batching.packing)", False),
    **_fsdp_lora(MODEL),
    f"{MODEL}.use_liger": needless(KERNELS, False),
    f"{MODEL}.use_fused_kernels": needless(KERNELS, False),
    f"{MODEL}.fused_kernel_options.impl_backend": needless(KERNELS, "torch"),
    f"{MODEL}.tiled_mlp.*": needless(MEMORY),
    f"{MODEL}.mtp.enable": refused("multi-token prediction is not in rlmega", False),
    f"{MODEL}.mtp.*": needless("only read with mtp.enable, which is refused"),
    **_megatron_lora(MODEL),
    # actor
    f"{A}.strategy": needless("verl's training backend; rlmega always trains with Megatron-Core (it decides whether "
                              "FSDP-only keys such as enable_gradient_checkpointing are read)"),
    f"{A}.rollout_n": needless(f"follows {RO}.n", f"${{oc.select:{RO}.n,1}}"),
    f"{A}.ppo_mini_batch_size": trained("actor.ppo_mini_batches", default=256, rule=_mini_batches(A),
                                        note="data.train_batch_size // ppo_mini_batch_size (both in prompts); "
                                             "refused unless it divides"),
    f"{A}.ppo_micro_batch_size": needless(MICRO_BATCH),
    f"{A}.ppo_micro_batch_size_per_gpu": needless(MICRO_BATCH),
    f"{A}.use_dynamic_bsz": mapped("actor.batching.max_tokens_per_microbatch", default=False,
                                   rule=_token_budget(f"{A}.use_dynamic_bsz", f"{A}.ppo_max_token_len_per_gpu"),
                                   note="true emits ppo_max_token_len_per_gpu; rlmega always batches by tokens"),
    f"{A}.ppo_max_token_len_per_gpu": mapped("actor.batching.max_tokens_per_microbatch", default=16384,
                                             rule=_token_budget(f"{A}.use_dynamic_bsz", f"{A}.ppo_max_token_len_per_gpu"),
                                             note="read with use_dynamic_bsz, as in verl"),
    f"{A}.clip_ratio": trained("actor.policy_loss.clip_ratio_low", "actor.policy_loss.clip_ratio_high", default=0.2,
                               rule=_clip_ratio, note="verl's fallback for a null clip_ratio_low/high"),
    f"{A}.clip_ratio_low": trained("actor.policy_loss.clip_ratio_low", default=0.2,
                                   rule=_loss_parameter("clip_ratio_low"),
                                   note="set for the losses that read it (vanilla, gspo, clip_cov, geo_mean, cispo)"),
    f"{A}.clip_ratio_high": trained("actor.policy_loss.clip_ratio_high", default=0.2,
                                    rule=_loss_parameter("clip_ratio_high"),
                                    note="set for the losses that read it (vanilla, gspo, clip_cov, geo_mean, cispo)"),
    f"{A}.clip_ratio_c": trained("actor.policy_loss.clip_ratio_c", default=3.0, rule=_loss_parameter("clip_ratio_c"),
                                 note="verl's vanilla loss always clips twice, so rlmega's ppo gets it too"),
    f"{A}.tau_pos": trained("actor.policy_loss.tau_pos", default=1.0, rule=_loss_parameter("tau_pos"), note="sapo only"),
    f"{A}.tau_neg": trained("actor.policy_loss.tau_neg", default=1.05, rule=_loss_parameter("tau_neg"),
                            note="sapo only"),
    f"{A}.freeze_vision_tower": needless("vision models are not in rlmega", False),
    f"{A}.policy_loss.loss_mode": trained("actor.policy_loss.name", default="vanilla", rule=_policy_loss,
                                          note="vanilla becomes ppo; gspo, sapo, gpg, clip_cov, kl_cov, geo_mean and "
                                               "cispo keep their names"),
    **{f"{A}.policy_loss.{name}": trained(f"actor.policy_loss.{name}", default=value, rule=_loss_parameter(name),
                                          note=f"{loss} only")
       for name, value, loss in (("clip_cov_ratio", 0.0002, "clip_cov"), ("clip_cov_lb", 1.0, "clip_cov"),
                                 ("clip_cov_ub", 5.0, "clip_cov"), ("kl_cov_ratio", 0.0002, "kl_cov"),
                                 ("ppo_kl_coef", 0.1, "kl_cov"))},
    f"{A}.loss_agg_mode": trained("actor.policy_loss.loss_agg_mode", default="token-mean", rule=_loss_agg_mode,
                                  note="gspo, sapo and geo_mean average per sequence in verl whatever it says, so "
                                       "they get seq-mean-token-mean"),
    f"{A}.loss_scale_factor": trained("actor.policy_loss.norm_horizon", default=None, rule=_norm_horizon,
                                      note="seq-mean-token-sum-norm only; null becomes the response length, verl's "
                                           "padded length"),
    f"{A}.entropy_coeff": trained("actor.policy_loss.entropy_coeff", default=0.0),
    f"{A}.calculate_entropy": needless("an entropy metric switch; it does not change the loss", False),
    f"{A}.use_kl_loss": trained("actor.policy_loss.kl_loss_coef", default=False, rule=_kl_loss_coef,
                                note="kl_loss_coef when true, else 0"),
    f"{A}.kl_loss_coef": trained("actor.policy_loss.kl_loss_coef", default=0.001, rule=_kl_loss_coef,
                                 note="0 unless use_kl_loss"),
    f"{A}.kl_loss_type": trained("actor.policy_loss.kl_estimator", default="low_var_kl", rule=_kl_estimator,
                                 note="rlmega has one estimator for the KL loss and the KL in the reward: refused if "
                                      "both are on and it differs from algorithm.kl_penalty; a '+' suffix is refused"),
    f"{A}.use_prefix_grouper": needless("shares prompt prefixes in attention for speed; the loss is the same", False),
    f"{A}.use_torch_compile": needless(KERNELS, True),
    f"{A}.ppo_epochs": trained("actor.ppo_epochs", default=1),
    f"{A}.shuffle": refused(SHUFFLE, False),
    f"{A}.data_loader_seed": needless("seeds verl's mini-batch shuffling, which is refused", 42),
    f"{A}.checkpoint.save_contents": mapped("export_hf", default=["model", "optimizer", "extra"], rule=_saved_contents,
                                            note="hf_model turns on export_hf (HF weights at the end); model and "
                                                 "optimizer must stay"),
    f"{A}.checkpoint.load_contents": refused("rlmega loads everything it saved", "${.save_contents}"),
    f"{A}.checkpoint.async_save": needless("changes when a save returns, not what it holds", False),
    f"{A}.use_fused_kernels": needless(KERNELS, f"${{oc.select:{MODEL}.use_fused_kernels,false}}"),
    **_router_replay(A, "actor"),
    f"{A}.load_weight": refused(LOAD_WEIGHT, True),
    f"{A}.grad_clip": trained("actor.optimizer.clip_grad", default=1.0, note="FSDP spelling of optim.clip_grad"),
    f"{A}.ulysses_sequence_parallel_size": mapped("layout.cp", default=1,
                                                  note="context parallelism splits each sequence as Ulysses does"),
    f"{A}.entropy_from_logits_with_chunking": needless(MEMORY, False),
    f"{A}.entropy_checkpointing": needless(MEMORY, False),
    f"{A}.use_remove_padding": needless("rlmega packs sequences itself (batching.packing)",
                                        f"${{oc.select:{MODEL}.use_remove_padding,false}}"),
    f"{A}.calculate_sum_pi_squared": needless("only feeds verl's optimal-token-baseline estimators, which are refused",
                                              False),
    f"{A}.sum_pi_squared_checkpointing": needless("only feeds verl's optimal-token-baseline estimators, which are "
                                                  "refused", False),
    **_optimizer(A, "actor", 1e-6),
    **_megatron(A, "actor"),
    **_fsdp(f"{A}.fsdp_config", "actor"),
    **_profiler(A),
    # reference
    f"{REF}.rollout_n": needless(f"follows {RO}.n", f"${{oc.select:{RO}.n,1}}"),
    f"{REF}.strategy": needless("verl's backend for the reference; rlmega uses Megatron-Core"),
    f"{REF}.use_torch_compile": needless(KERNELS, f"${{oc.select:{A}.use_torch_compile,true}}"),
    f"{REF}.log_prob_micro_batch_size": needless(MICRO_BATCH),
    f"{REF}.log_prob_micro_batch_size_per_gpu": needless(MICRO_BATCH),
    f"{REF}.log_prob_use_dynamic_bsz": mapped(
        "ref.batching.max_tokens_per_microbatch", default=f"${{oc.select:{A}.use_dynamic_bsz,false}}",
        rule=_token_budget(f"{REF}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_max_token_len_per_gpu"),
        note="true emits log_prob_max_token_len_per_gpu"),
    f"{REF}.log_prob_max_token_len_per_gpu": mapped(
        "ref.batching.max_tokens_per_microbatch", default=f"${{oc.select:{A}.ppo_max_token_len_per_gpu,16384}}",
        rule=_token_budget(f"{REF}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_max_token_len_per_gpu"),
        note="read with log_prob_use_dynamic_bsz, as in verl"),
    **_router_replay(REF, "ref"),
    **_megatron(REF, "ref"),
    **_fsdp(f"{REF}.fsdp_config", "ref"),
    f"{REF}.ulysses_sequence_parallel_size": mapped(
        "layout.cp", default=f"${{oc.select:{A}.ulysses_sequence_parallel_size,1}}",
        note="one layout for all roles: a value other than the actor's is refused"),
    f"{REF}.entropy_from_logits_with_chunking": needless(MEMORY, False),
    f"{REF}.entropy_checkpointing": needless(MEMORY, False),
    f"{REF}.load_weight": refused(LOAD_WEIGHT, True),
    **_profiler(REF),
    # rollout
    f"{RO}.name": mapped("rollout.backend", default="???", rule=_backend, note="vllm, sglang, hf; trtllm is refused"),
    f"{RO}.mode": needless("verl's sync or async server choice; rlmega drives its engines itself", "async"),
    f"{RO}.temperature": trained("rollout.temperature", default=1.0, rule=_temperature(RO),
                                 note="0 when do_sample is false"),
    f"{RO}.do_sample": trained("rollout.temperature", default=True, rule=_temperature(RO),
                               note="false samples greedily: temperature 0"),
    f"{RO}.top_k": trained("rollout.top_k", default=-1, rule=_top_k, note="-1 and 0 (off) become null"),
    f"{RO}.top_p": trained("rollout.top_p", default=1.0, rule=lambda value, verl: float(value)),
    f"{RO}.prompt_length": needless("the prompt limit is data.max_prompt_length", "${oc.select:data.max_prompt_length,512}"),
    f"{RO}.response_length": trained("rollout.max_new_tokens", default="${oc.select:data.max_response_length,512}"),
    f"{RO}.dtype": refused("rlmega's engines take their dtype from rollout.engine_kwargs; set dtype there", "bfloat16",
                           accept=lambda value, verl: value in ("bfloat16", "bf16")),
    f"{RO}.gpu_memory_utilization": mapped("rollout.gpu_memory_utilization", default=0.5),
    f"{RO}.ignore_eos": refused("rlmega ends each response at EOS", False),
    f"{RO}.enforce_eager": needless(ENGINE, False),
    f"{RO}.cudagraph_capture_sizes": needless(ENGINE),
    f"{RO}.free_cache_engine": needless("rlmega's colocated engines release their memory while training runs (rollout.colocated_offload)",
                                        True),
    f"{RO}.tensor_model_parallel_size": mapped("rollout.tensor_parallel_size", default=2),
    f"{RO}.data_parallel_size": mapped("rollout.data_parallel_size", default=1),
    f"{RO}.expert_parallel_size": mapped("rollout.expert_parallel_size", default=1),
    f"{RO}.pipeline_model_parallel_size": refused("rlmega's engines do not split layers into pipeline stages", 1),
    f"{RO}.max_num_batched_tokens": mapped("rollout.max_num_batched_tokens", default=8192),
    f"{RO}.max_model_len": needless(ENGINE),
    f"{RO}.max_num_seqs": needless(ENGINE, 256),
    f"{RO}.enable_chunked_prefill": needless(ENGINE, True),
    f"{RO}.enable_prefix_caching": needless(ENGINE, True),
    f"{RO}.logprobs_mode": refused("rlmega's engines report processed log-probs (of the distribution they sample)",
                                   "processed_logprobs"),
    f"{RO}.scheduling_policy": needless(ENGINE, "fcfs"),
    f"{RO}.load_format": needless("how verl first fills the engine; rlmega's engines load model.path, then receive "
                                  "the trained weights", "dummy"),
    f"{RO}.log_prob_micro_batch_size": needless(MICRO_BATCH),
    f"{RO}.log_prob_micro_batch_size_per_gpu": needless(MICRO_BATCH),
    f"{RO}.log_prob_use_dynamic_bsz": needless("rlmega recomputes old log-probs with actor.batching",
                                               f"${{oc.select:{A}.use_dynamic_bsz,false}}"),
    f"{RO}.log_prob_max_token_len_per_gpu": needless("rlmega recomputes old log-probs with actor.batching",
                                                     f"${{oc.select:{A}.ppo_max_token_len_per_gpu,16384}}"),
    f"{RO}.disable_log_stats": needless(ENGINE, True),
    f"{RO}.n": trained("rollout.n", default=1),
    f"{RO}.over_sample_rate": refused("rlmega waits for every response of a step", 0),
    f"{RO}.multi_stage_wake_up": needless("memory only, while verl wakes its engines", False),
    f"{RO}.engine_kwargs.vllm": mapped("rollout.engine_kwargs", default={}, rule=_engine_kwargs("vllm"),
                                       note="when the backend is vllm"),
    f"{RO}.engine_kwargs.sglang": mapped("rollout.engine_kwargs", default={}, rule=_engine_kwargs("sglang"),
                                         note="when the backend is sglang"),
    f"{RO}.engine_kwargs.trtllm": refused("TensorRT-LLM engines are not in rlmega", {}),
    f"{RO}.val_kwargs.temperature": trained("rollout.val_temperature", default=0, rule=_val_temperature,
                                            note="0 when val_kwargs.do_sample is false"),
    f"{RO}.val_kwargs.do_sample": trained("rollout.val_temperature", default=False, rule=_val_temperature,
                                          note="false: temperature 0 (greedy)"),
    f"{RO}.val_kwargs.top_k": trained("rollout.val_temperature", default=-1, rule=_val_temperature,
                                      note="rlmega validates with rollout.top_k: a sampled validation with another "
                                           "top_k is refused"),
    f"{RO}.val_kwargs.top_p": trained("rollout.val_temperature", default=1.0, rule=_val_temperature,
                                      note="rlmega validates with rollout.top_p: a sampled validation with another "
                                           "top_p is refused"),
    f"{RO}.val_kwargs.n": refused("rlmega generates one response per validation prompt", 1,
                                  accept=lambda value, verl: value == 1),
    f"{RO}.multi_turn.enable": refused("multi-turn rollouts: verl's tool and interaction configs do not translate; "
                                       "set rlmega's agent section (rlmega/agent/README.md)", False),
    f"{RO}.multi_turn.*": needless("only read with multi_turn.enable, which is refused"),
    f"{RO}.calculate_log_probs": needless("rlmega always keeps the engine's log-probs (rollout correction uses them)",
                                          False),
    f"{RO}.agent.default_agent_loop": refused("agent loops are not in rlmega: each sample is one response",
                                              "single_turn_agent"),
    f"{RO}.agent.agent_loop_config_path": refused("agent loops are not in rlmega: each sample is one response"),
    f"{RO}.agent.custom_async_server.path": refused("rlmega's engines are its own vllm, sglang and hf adapters"),
    f"{RO}.agent.*": needless("sizes verl's agent-loop workers"),
    f"{RO}.checkpoint_engine.update_weights_bucket_megabytes": mapped("sync.bucket_bytes", default=2048,
                                                                      rule=_bucket_bytes, note="MiB become bytes"),
    f"{RO}.checkpoint_engine.*": needless("rlmega's weight sync is configured in its sync section"),
    f"{RO}.trace.backend": refused("rollout tracing is not in rlmega"),
    f"{RO}.trace.*": needless("only read with trace.backend, which is refused"),
    f"{RO}.skip_rollout": refused("rlmega always generates; it does not replay dumped rollouts", False),
    f"{RO}.skip_dump_dir": needless("only read with skip_rollout, which is refused", "/tmp/rollout_dump"),
    f"{RO}.skip_tokenizer_init": needless(ENGINE, True),
    f"{RO}.enable_rollout_routing_replay": needless("the engines record routing when actor.router_replay is r3",
                                                    False),
    f"{RO}.prometheus.enable": refused("rlmega does not export engine metrics to Prometheus", False),
    f"{RO}.prometheus.*": needless("only read with prometheus.enable, which is refused"),
    f"{RO}.quantization": refused("quantised rollout is not in rlmega; its engines run the trained weights"),
    f"{RO}.quantization_config_file": refused("quantised rollout is not in rlmega; its engines run the trained weights"),
    f"{RO}.mtp": needless(f"follows {MODEL}.mtp", f"${{oc.select:{MODEL}.mtp, null}}"),
    f"{RO}.layer_name_map.*": needless("how verl renames fused layers for the engine; rlmega's bridge names them"),
    f"{RO}.layered_summon": needless(FSDP, False),
    **_profiler(RO, f"${{oc.select:{A}.profiler.enable,false}}"),
    # ------------------------------------------------------------------------------------- critic
    "critic.enable": refused("rlmega trains a critic exactly when algorithm.adv_estimator is gae",
                             accept=lambda value, verl: value is None or bool(value) == _trains_critic(verl)),
    "critic.rollout_n": needless(f"follows {RO}.n", f"${{oc.select:{RO}.n,1}}"),
    "critic.strategy": needless("verl's backend for the critic; rlmega uses Megatron-Core"),
    **_optimizer("critic", "critic", 1e-5),
    **_megatron("critic", "critic"),
    **_fsdp("critic.model.fsdp_config", "critic"),
    "critic.model.path": refused("rlmega starts the critic from model.path (the actor's checkpoint)",
                                 "~/models/deepseek-llm-7b-chat",
                                 accept=lambda value, verl: not _trains_critic(verl)
                                 or _expand(value) == _expand(verl(f"{MODEL}.path"))),
    "critic.model.tokenizer_path": needless("the critic reads the actor's tokenizer",
                                            f"${{oc.select:{MODEL}.path,\"~/models/deepseek-llm-7b-chat\"}}"),
    **_model_overrides("critic.model", "critic"),
    "critic.model.external_lib": refused("rlmega builds only the architectures it supports (rlmega/models)",
                                         f"${{oc.select:{MODEL}.external_lib,null}}"),
    "critic.model.trust_remote_code": refused("rlmega loads models without remote code",
                                              f"${{oc.select:{MODEL}.trust_remote_code,false}}"),
    **_megatron_lora("critic.model"),
    **_fsdp_lora("critic.model"),
    "critic.model.use_shm": needless("copies the model to /dev/shm to load it faster", False),
    "critic.model.enable_gradient_checkpointing": mapped(
        "critic.recompute_granularity", default=True, rule=_critic_only(_recompute_full("critic")),
        note="FSDP only in verl: true becomes full recomputation"),
    "critic.model.enable_activation_offload": needless(MEMORY, False),
    "critic.model.use_remove_padding": needless("rlmega packs sequences itself (batching.packing)", False),
    "critic.model.tiled_mlp.*": needless(MEMORY),
    "critic.ppo_mini_batch_size": trained("critic.ppo_mini_batches", default=f"${{oc.select:{A}.ppo_mini_batch_size,256}}",
                                          rule=_critic_only(_mini_batches("critic")),
                                          note="data.train_batch_size // ppo_mini_batch_size; gae only"),
    "critic.ppo_micro_batch_size": needless(MICRO_BATCH),
    "critic.ppo_micro_batch_size_per_gpu": needless(MICRO_BATCH, "${oc.select:.ppo_micro_batch_size,null}"),
    "critic.forward_micro_batch_size": needless(MICRO_BATCH, "${oc.select:.ppo_micro_batch_size,null}"),
    "critic.forward_micro_batch_size_per_gpu": needless(MICRO_BATCH, "${oc.select:.ppo_micro_batch_size_per_gpu,null}"),
    "critic.use_dynamic_bsz": mapped("critic.batching.max_tokens_per_microbatch",
                                     default=f"${{oc.select:{A}.use_dynamic_bsz,false}}",
                                     rule=_critic_only(_token_budget("critic.use_dynamic_bsz",
                                                                     "critic.ppo_max_token_len_per_gpu")),
                                     note="true emits ppo_max_token_len_per_gpu"),
    "critic.ppo_max_token_len_per_gpu": mapped("critic.batching.max_tokens_per_microbatch", default=32768,
                                               rule=_critic_only(_token_budget("critic.use_dynamic_bsz",
                                                                               "critic.ppo_max_token_len_per_gpu")),
                                               note="read with use_dynamic_bsz, as in verl"),
    "critic.forward_max_token_len_per_gpu": needless("rlmega computes values with critic.batching",
                                                     "${.ppo_max_token_len_per_gpu}"),
    "critic.ppo_epochs": trained("critic.ppo_epochs", default=f"${{oc.select:{A}.ppo_epochs,1}}",
                                 rule=_critic_only(_same), note="gae only"),
    "critic.shuffle": refused(SHUFFLE, f"${{oc.select:{A}.shuffle,false}}"),
    "critic.data_loader_seed": needless("seeds verl's mini-batch shuffling, which is refused",
                                        f"${{oc.select:{A}.data_loader_seed,null}}"),
    "critic.cliprange_value": trained("critic.critic_loss.cliprange_value", default=0.5, rule=_critic_only(_same),
                                      note="gae only"),
    "critic.loss_agg_mode": trained("critic.critic_loss.loss_agg_mode",
                                    default=f"${{oc.select:{A}.loss_agg_mode,token-mean}}", rule=_critic_only(_same),
                                    note="gae only"),
    "critic.checkpoint.*": needless("the critic is saved in the run's checkpoint with the actor"),
    "critic.ulysses_sequence_parallel_size": mapped("layout.cp", default=1, rule=_critic_only(_same),
                                                    note="one layout for all roles: a value other than the actor's "
                                                         "is refused"),
    "critic.grad_clip": trained("critic.optimizer.clip_grad", default=1.0, rule=_critic_only(_same),
                                note="FSDP spelling of optim.clip_grad"),
    "critic.nccl_timeout": needless("rlmega's waits follow cluster.timeout_s", 600),
    "critic.load_weight": refused(LOAD_WEIGHT, True),
    **_profiler("critic"),
    # ------------------------------------------------------------------------------------- reward
    "reward_model.enable": refused("model-based rewards are not in rlmega; it scores with rules or "
                                   "reward.user_function", False),
    "reward_model.reward_manager": refused(
        "rlmega scores each response by the rule of its data_source or by reward.user_function, as verl's naive, "
        "prime and dapo managers do; other managers are not in rlmega", "naive", accept=_reward_manager),
    "reward_model.overlong_buffer.enable": trained("algorithm.overlong_buffer_length", default=False,
                                                   rule=_overlong_buffer, note="DAPO: len when true, else 0"),
    "reward_model.overlong_buffer.len": trained("algorithm.overlong_buffer_length", default=0, rule=_overlong_buffer,
                                                note="DAPO: 0 unless overlong_buffer.enable"),
    "reward_model.overlong_buffer.penalty_factor": trained("algorithm.overlong_penalty_factor", default=0.0,
                                                           rule=_overlong_penalty, note="DAPO"),
    "reward_model.overlong_buffer.log": needless("a logging switch of verl's DAPO reward manager", False),
    "reward_model.launch_reward_fn_async": needless("rlmega scores in a worker pool (reward.num_workers)", False),
    "reward_model.sandbox_fusion.url": refused("sandboxed code execution is not in rlmega; score code with "
                                               "reward.user_function"),
    "reward_model.sandbox_fusion.*": needless("only read with sandbox_fusion.url, which is refused"),
    "reward_model.reward_loop_source": refused("custom reward loops are not in rlmega", "register"),
    "reward_model.reward_loop_module_path": refused("custom reward loops are not in rlmega"),
    "reward_model.reward_loop_class_name": needless("only read with reward_loop_module_path, which is refused"),
    "reward_model.use_reward_loop": needless("chooses among verl's reward worker implementations", True),
    "reward_model.num_workers": mapped("reward.num_workers", default=1, note="processes that score responses"),
    "reward_model.*": needless("only read with reward_model.enable (a reward model), which is refused"),
    "reward_manager.source": refused("custom reward managers are not in rlmega", "register"),
    "reward_manager.name": refused("rlmega scores as verl's naive, prime and dapo managers do",
                                   "${oc.select:reward_model.reward_manager,naive}", accept=_reward_manager),
    "reward_manager.module.path": refused("custom reward managers are not in rlmega"),
    "reward_manager.module.name": needless("only read with reward_manager.module.path, which is refused",
                                           "custom_reward_manager"),
    "custom_reward_function.path": mapped("reward.user_function", default=None, rule=_user_function,
                                          note="path:name; ~ is expanded"),
    "custom_reward_function.name": mapped("reward.user_function", default="compute_score", rule=_user_function,
                                          note="with custom_reward_function.path"),
    # ---------------------------------------------------------------------------------- algorithm
    "algorithm.gamma": trained("algorithm.gamma", default=1.0),
    "algorithm.lam": trained("algorithm.lam", default=1.0),
    "algorithm.adv_estimator": trained("algorithm.adv_estimator", default="gae", rule=_estimator,
                                       note="same names; grpo_vectorized and rloo_vectorized become grpo and rloo; "
                                            "opo and the optimal-token baselines are refused"),
    "algorithm.norm_adv_by_std_in_grpo": trained("algorithm.norm_adv_by_std", default=True),
    "algorithm.use_kl_in_reward": trained("algorithm.kl_in_reward_coef", default=False, rule=_kl_in_reward_coef,
                                          note="kl_ctrl.kl_coef when true, else 0"),
    "algorithm.kl_penalty": trained("actor.policy_loss.kl_estimator", default="kl", rule=_kl_estimator,
                                    note=f"shared with {A}.kl_loss_type (see there)"),
    "algorithm.kl_ctrl.type": refused("the adaptive KL controller is not in rlmega; its KL coefficient is fixed",
                                      "fixed", accept=lambda value, verl: value == "fixed"
                                      or not verl("algorithm.use_kl_in_reward")),
    "algorithm.kl_ctrl.kl_coef": trained("algorithm.kl_in_reward_coef", default=0.001, rule=_kl_in_reward_coef,
                                         note="0 unless use_kl_in_reward"),
    "algorithm.kl_ctrl.horizon": needless("only read by the adaptive controller, which is refused", 10000),
    "algorithm.kl_ctrl.target_kl": needless("only read by the adaptive controller, which is refused", 0.1),
    "algorithm.use_pf_ppo": refused("policy-filtration PPO (reweighting samples by reward) is not in rlmega", False),
    "algorithm.pf_ppo.*": needless("only read with use_pf_ppo, which is refused"),
    "algorithm.filter_groups.enable": trained("algorithm.dynamic_sampling", default=False,
                                              note="DAPO's dynamic sampling"),
    "algorithm.filter_groups.metric": refused(
        "rlmega drops groups whose shaped scores are all equal (verl's seq_reward; seq_final_reward without KL in the "
        "reward)", accept=_filter_metric),
    "algorithm.filter_groups.max_num_gen_batches": trained(
        "algorithm.max_generation_rounds", default=0, rule=_generation_rounds,
        note="ceil(max_num_gen_batches * data.gen_batch_size / data.train_batch_size); 0 (no limit) is refused"),
    **{f"algorithm.rollout_correction.{name}": trained(f"algorithm.rollout_correction.{name}", default=value,
                                                       rule=rule, note=note)
       for name, value, rule, note in (
           ("rollout_is", None, _rollout_is, "token, sequence or null"),
           ("rollout_is_threshold", 2.0, None, ""),
           ("rollout_rs", None, _rollout_rs, "token, sequence, geometric or null; verl's *_k1/k2/k3 are refused"),
           ("rollout_rs_threshold", None, _rs_threshold, "a number (verl's 'lower_upper' strings are refused)"),
           ("rollout_rs_threshold_lower", None, None, ""),
           ("rollout_token_veto_threshold", None, None, ""),
           ("bypass_mode", False, None, ""))},
    "algorithm.rollout_correction.loss_type": refused(
        "rlmega's bypass mode keeps the PPO clipped loss (ppo_clip)", "ppo_clip",
        accept=lambda value, verl: value == "ppo_clip" or not verl("algorithm.rollout_correction.bypass_mode")),
    "algorithm.rollout_correction.rollout_is_batch_normalize": refused(
        "rlmega does not renormalise IS weights over the batch", False),
    # ------------------------------------------------------------------------------------ trainer
    "trainer.balance_batch": needless("reorders the batch to balance tokens over data-parallel ranks; rlmega balances "
                                      "micro-batches by tokens", True),
    "trainer.total_epochs": mapped("trainer.total_epochs", default=30, rule=_after_training_steps,
                                   note="not emitted when total_training_steps is set, which wins in verl"),
    "trainer.total_training_steps": mapped("trainer.total_steps", default=None, rule=_unless_null),
    "trainer.project_name": mapped("metrics.project", default="verl_examples"),
    "trainer.experiment_name": mapped("metrics.experiment_name", default="gsm8k"),
    "trainer.logger": mapped("metrics.backends", default=["console", "wandb"], rule=_loggers,
                             note="console, wandb, mlflow, tensorboard; file becomes jsonl; others are refused"),
    "trainer.log_val_generations": mapped("trainer.log_val_generations", default=0),
    "trainer.nnodes": trained("layout.world_size", default=1, rule=_world_size,
                              note="nnodes * n_gpus_per_node, carried so that the parallel degrees fit"),
    "trainer.n_gpus_per_node": trained("layout.world_size", default=8, rule=_world_size,
                                       note="nnodes * n_gpus_per_node, carried so that the parallel degrees fit"),
    "trainer.save_freq": mapped("trainer.save_every", default=-1, rule=_every,
                                note="-1 becomes 0; rlmega also saves at the end"),
    "trainer.esi_redundant_time": needless("times saves before a cloud instance expires; rlmega saves on SIGTERM", 0),
    "trainer.resume_mode": mapped("resume", default="auto", rule=_resume,
                                  note="auto: auto; disable: never; resume_path is refused"),
    "trainer.resume_from_path": refused("rlmega resumes from run_dir's latest checkpoint; point run_dir at that run"),
    "trainer.del_local_ckpt_after_load": needless("rlmega keeps the checkpoint it resumes from", False),
    "trainer.val_before_train": mapped("trainer.val_before_train", default=True),
    "trainer.val_only": refused("rlmega has no validation-only run", False),
    "trainer.test_freq": mapped("trainer.val_every", default=-1, rule=_every, note="-1 becomes 0 (never)"),
    "trainer.critic_warmup": mapped("trainer.critic_warmup", default=0, rule=_critic_warmup,
                                    note="verl updates the actor from step N on (N - 1 critic-only steps); "
                                         "rlmega's value counts the critic-only steps"),
    "trainer.default_hdfs_dir": refused("rlmega writes checkpoints under run_dir only"),
    "trainer.default_local_dir": mapped("run_dir", default="checkpoints/${trainer.project_name}/${trainer.experiment_name}",
                                        rule=lambda value, verl: _expand(value),
                                        note="rlmega writes everything of the run there"),
    "trainer.max_actor_ckpt_to_keep": mapped("trainer.max_checkpoints_to_keep", default=None, rule=_unless_null),
    "trainer.max_critic_ckpt_to_keep": mapped("trainer.max_checkpoints_to_keep", default=None,
                                              rule=_critic_only(_unless_null),
                                              note="one checkpoint holds every role: must equal the actor's"),
    "trainer.remove_previous_ckpt_in_save": mapped("trainer.max_checkpoints_to_keep", default=False,
                                                   rule=lambda value, verl: 1 if value else SKIP,
                                                   note="older verl: true keeps 1"),
    "trainer.ray_wait_register_center_timeout": needless("rlmega's start-up waits follow cluster.timeout_s", 300),
    "trainer.device": refused("rlmega trains on CUDA GPUs (or on CPU)", "cuda"),
    "trainer.rollout_data_dir": refused("rlmega does not dump training rollouts; trainer.log_val_generations logs "
                                        "validation samples"),
    "trainer.validation_data_dir": refused("rlmega does not dump validation generations to files; "
                                           "trainer.log_val_generations logs them"),
    "trainer.use_legacy_worker_impl": needless("chooses among verl's worker implementations", "auto"),
    # -------------------------------------------------------------------------------------- other
    "global_profiler.tool": refused("rlmega has no profiler hook; run the job under nsys or torch.profiler"),
    "global_profiler.*": needless("only read with global_profiler.tool, which is refused"),
    "transfer_queue.enable": refused("verl's TransferQueue data plane is not in rlmega", False),
    "ray_kwargs.timeline_json_file": refused("rlmega does not write a Ray timeline"),
    "ray_kwargs.*": needless("rlmega starts or joins Ray itself (cluster.ray_address)"),
}

SECTIONS = ("data", "actor_rollout_ref.model", "actor_rollout_ref.actor", "actor_rollout_ref.ref",
            "actor_rollout_ref.rollout", "actor_rollout_ref", "critic", "reward_model", "reward_manager",
            "custom_reward_function", "algorithm", "trainer", "global_profiler", "transfer_queue", "ray_kwargs")



def find_setting(key: str) -> Optional[Setting]:
    """The table's entry for a verl key: its own, else the nearest ``prefix.*`` above it; ``_target_`` keys
    (verl's config class names) need nothing."""
    if key in VERL_SETTINGS:
        return VERL_SETTINGS[key]
    if key.rpartition(".")[2] == "_target_":
        return TARGET_KEYS
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        wildcard = ".".join(parts[:end]) + ".*"
        if wildcard in VERL_SETTINGS:
            return VERL_SETTINGS[wildcard]
    return None


TARGET_KEYS = needless("names verl's config class")

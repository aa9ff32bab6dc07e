"""The settings verl repeats per role (actor, reference, critic): optimizer, Megatron and FSDP engine sections,
model overrides, LoRA, profiler and router replay, each built for one role; and the reasons the table gives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from rlmega.config.verl_rules import (A, REF, _any_of, _betas, _critic_only, _decay_steps, _dtype, _ep_and_etp,
                                      _expert_tp, _min_lr, _same, _schedule, _sequence_parallel, _warmup_steps,
                                      _wsd_decay_steps)
from rlmega.config.verl_setting import SKIP, Refused, Setting, mapped, needless, refused, trained

if TYPE_CHECKING:
    from rlmega.config.verl import VerlConfig


MICRO_BATCH = ("micro-batch size in sequences; rlmega forms micro-batches by a token budget "
               "(batching.max_tokens_per_microbatch) and the loss does not depend on the split")
FSDP = "an FSDP sharding setting; rlmega trains with Megatron-Core"
KERNELS = "a kernel or compile choice; it changes speed, not what is trained"
MEMORY = "saves memory only; rlmega bounds memory by its token budget and recomputation"
ENGINE = "an engine tuning knob; rlmega leaves it at the engine's default (rollout.engine_kwargs takes engine arguments)"
CONFIG_AS_IS = "rlmega builds the model from its config.json as it is"
SHUFFLE = "rlmega keeps each step's responses in order when it splits them into mini-batches"
PROFILING = "per-role profiling is not in rlmega; run the job under nsys or torch.profiler"
ROUTER_REPLAY = "the reference model routes by itself in rlmega"
LOAD_WEIGHT = "rlmega always starts from the weights in model.path"
OFFLOAD = ("verl's param_offload and optimizer_offload (Megatron's grad_offload too) each move one kind of state to "
           "host memory between uses; rlmega's offload moves parameters, gradients and optimizer state together "
           "between calls, so any of them turns it on; the optimizer still steps on the GPU")
NO_DROPOUT = "rlmega trains without dropout (0 is its behaviour); it cannot train with dropout"
# HF config fields verl recipes zero through override_config; rlmega has no dropout, so 0 is what it does.
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop", "dropout")


def _no_dropout(value: Any, verl: "VerlConfig") -> bool:
    return value == 0


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
            note="the reference's weights stay in host memory between calls; rlmega's reference offloads by default "
                 "(verl's default is not carried)")
        no_grads = "the reference has no gradients or optimizer state"
        table[f"{megatron}.grad_offload"] = needless(no_grads, False)
        table[f"{megatron}.optimizer_offload"] = needless(no_grads, False)
    else:
        fsdp = f"{owner}.fsdp_config" if role == "actor" else f"{owner}.model.fsdp_config"
        offload = gate(_any_of(*offload_keys, f"{fsdp}.param_offload", f"{fsdp}.optimizer_offload"))
        for key in offload_keys:
            table[key] = dataclasses.replace(mapped(f"{role}.offload", default=False, rule=offload, note=OFFLOAD),
                                             caveat=True)
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
        **{f"{transformer}.{name}": refused(NO_DROPOUT, accept=_no_dropout)
           for name in ("hidden_dropout", "attention_dropout")},
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
                                                rule=_any_of(f"{REF}.megatron.param_offload", f"{fsdp}.param_offload"),
                                                note="FSDP's parameter offload of the reference: its weights stay in "
                                                     "host memory between calls, as rlmega's ref.offload keeps them "
                                                     "(on by default in rlmega)")
        table[f"{fsdp}.optimizer_offload"] = needless("the reference has no optimizer state", False)
    else:
        offload = gate(_any_of(f"{owner}.megatron.param_offload", f"{owner}.megatron.grad_offload",
                               f"{owner}.megatron.optimizer_offload", f"{fsdp}.param_offload", f"{fsdp}.optimizer_offload"))
        for name in ("param_offload", "optimizer_offload"):
            table[f"{fsdp}.{name}"] = dataclasses.replace(
                mapped(f"{role}.offload", default=False, rule=offload, note=OFFLOAD), caveat=True)
    return table


def _model_overrides(model: str, role: str) -> dict[str, Setting]:
    gate = _critic_only if role == "critic" else (lambda rule: rule)
    return {
        f"{model}.override_config.model_config": refused(CONFIG_AS_IS, {}),
        f"{model}.override_config.moe_config.freeze_moe_router": mapped(f"{role}.freeze_moe_router", default=False,
                                                                        rule=gate(_same)),
        f"{model}.override_config.attn_implementation": needless("an HF attention choice; rlmega picks Megatron's kernels"),
        **{f"{model}.override_config.{name}": refused(NO_DROPOUT, accept=_no_dropout) for name in DROPOUT_FIELDS},
        f"{model}.override_config.*": refused(CONFIG_AS_IS),
    }


NO_CRITIC_LORA = "rlmega trains LoRA adapters on the actor only (actor.lora); its critic trains every weight"


def _megatron_lora(model: str, target: Optional[str] = None) -> dict[str, Setting]:
    """verl's Megatron LoRA keys; with ``target`` (``actor``) they become ``{target}.lora``."""
    if target is None:
        return {f"{model}.lora.rank": refused(NO_CRITIC_LORA, 0),
                f"{model}.lora.*": needless("only read with lora.rank > 0, which is refused")}
    on = _with_lora(f"{model}.lora.rank")
    return {
        f"{model}.lora.rank": mapped(f"{target}.lora.rank", default=0, rule=on(_same_value)),
        f"{model}.lora.alpha": mapped(f"{target}.lora.alpha", default=32, rule=on(_same_value)),
        f"{model}.lora.target_modules": mapped(f"{target}.lora.target_modules", default=None, rule=on(_lora_modules),
                                               note="HF names (q_proj, ...) become Megatron's (linear_qkv, ...)"),
        f"{model}.lora.dropout": mapped(f"{target}.lora.dropout", default=0.0, rule=on(_same_value)),
        f"{model}.lora.*": needless("the adapters' other settings: rlmega's are the plain low-rank pair"),
    }


def _fsdp_lora(model: str, target: Optional[str] = None) -> dict[str, Setting]:
    """verl's FSDP LoRA keys; with ``target`` (``actor``) they become ``{target}.lora``."""
    if target is None:
        only = needless("only read with lora_rank > 0, which is refused")
        table = {f"{model}.lora_rank": refused(NO_CRITIC_LORA, 0)}
        table.update({f"{model}.{name}": dataclasses.replace(only, default=value) for name, value in (
            ("lora_alpha", 16), ("target_modules", "all-linear"), ("exclude_modules", None), ("lora_adapter_path", None))})
        return table
    on = _with_lora(f"{model}.lora_rank")
    return {
        f"{model}.lora_rank": mapped(f"{target}.lora.rank", default=0, rule=on(_same_value)),
        f"{model}.lora_alpha": mapped(f"{target}.lora.alpha", default=16, rule=on(_same_value)),
        f"{model}.target_modules": mapped(f"{target}.lora.target_modules", default="all-linear",
                                          rule=on(_lora_modules),
                                          note="HF names (q_proj, ...) become Megatron's (linear_qkv, ...)"),
        f"{model}.exclude_modules": refused("rlmega adapts the target modules of every decoder layer"),
        f"{model}.lora_adapter_path": refused("rlmega starts LoRA from fresh adapters (B = 0) over model.path"),
    }


def _same_value(value: Any, verl: Any) -> Any:
    return value


def _with_lora(rank_key: str):
    """A rule that applies only where ``rank_key`` turns LoRA on (verl has an FSDP and a Megatron set of keys; the
    set whose rank is 0 says nothing)."""
    def wrap(rule):
        return lambda value, verl: rule(value, verl) if (verl(rank_key) or 0) > 0 else SKIP
    return wrap


_HF_LINEAR = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def _lora_modules(value: Any, verl: Any) -> Any:
    """verl's target modules (``all-linear``, HF or Megatron names) as rlmega's Megatron names."""
    from rlmega.models.lora import LINEAR_MODULES

    if value is None or value == "all-linear":
        return SKIP  # rlmega's default: every linear layer of the decoder
    names = [value] if isinstance(value, str) else list(value)
    unknown = [name for name in names if name not in LINEAR_MODULES and name not in _HF_LINEAR]
    if unknown:
        raise Refused(f"target_modules {unknown}: rlmega adapts {', '.join(LINEAR_MODULES)} (or their HF names "
                      f"{', '.join(_HF_LINEAR)})")
    megatron = {_HF_LINEAR.get(name, name) for name in names}
    return [name for name in LINEAR_MODULES if name in megatron]

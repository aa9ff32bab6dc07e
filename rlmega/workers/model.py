"""Building a worker's Megatron model, optimizer and learning-rate schedule for a parallel layout.

The critic is the same backbone with its output layer replaced by a scalar value head; the reward
model is a sequence-classification checkpoint, whose score head the model builder adds itself.
"""

from __future__ import annotations

import torch

from rlmega.models import lora
from rlmega.models.reward_head import ScoreHead
from rlmega.models.spec import ModelSpec, build_chunks, has_transformer_engine
from rlmega.parallel.layout import ParallelLayout
from rlmega.workers import lm_head
from rlmega.workers.config import OptimizerConfig, WorkerConfig
from rlmega.workers.optimizer_state import sub_optimizers
from rlmega.workers.roles import ROLES, Output, Role


# Selective-recompute modules Megatron checkpoints with CheckpointWithoutOutput, which reads
# transformer-engine's FP8 state (megatron/core/tensor_parallel/random.py, 0.16).
OUTPUT_DISCARDING_RECOMPUTE = {"layernorm", "moe_act", "mla_up_proj"}


def resolve_dtype(config: WorkerConfig) -> torch.dtype:
    if config.dtype is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]


def value_head(config) -> ScoreHead:
    """The critic's scalar value head, in the output layer's place: a one-label score head
    (``rlmega.models.reward_head.ScoreHead``: whole on every TP rank, gradients exact under sequence
    parallelism), zero at the start, and marked so that the bridge skips it (HF checkpoints have no
    value head)."""
    head = ScoreHead(config, num_labels=1)
    torch.nn.init.zeros_(head.weight)
    head.weight.is_value_head = True
    return head


def build_model(spec: ModelSpec, layout: ParallelLayout, config: WorkerConfig) -> tuple[list, object]:
    """This rank's model chunks and their ``TransformerConfig``.

    Trained roles are wrapped in Megatron's DDP (gradient buffers, data-parallel reduction); bf16
    models in ``Float16Module``. Megatron's process groups must exist.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    role = ROLES[config.role]
    check_head(spec, config.role)
    dtype = resolve_dtype(config)
    sequence_parallel = config.uses_sequence_parallel(layout.tp, moe=spec.num_experts is not None,
                                                      gpu=torch.cuda.is_available())
    if role.output is Output.VALUES and spec.tie_word_embeddings:
        spec = _untied(spec)
    discarding = sorted(set(config.recompute_modules or ()) & OUTPUT_DISCARDING_RECOMPUTE)
    if discarding and not has_transformer_engine():
        raise ValueError(f"recompute_modules {discarding}: Megatron recomputes these with its output-discarding "
                         "checkpoint, which needs transformer-engine; without it use core_attn, mlp, moe or shared_experts")
    if config.activation_offload_layers and not torch.cuda.is_available():
        raise ValueError("activation_offload_layers moves activations from the GPU to host memory and needs CUDA; "
                         "on CPU use recompute_granularity instead")
    replay = {}
    if config.router_replay != "none":
        _check_router_replay(spec, config, role)
        replay = dict(moe_enable_routing_replay=True)
    transformer_config = spec.transformer_config(
        layout, params_dtype=dtype, sequence_parallel=sequence_parallel, init_method_std=0.02,
        **config.memory_settings(), **replay,
    )
    models = build_chunks(spec, layout, transformer_config)
    if spec.vision is not None:
        if layout.cp > 1:
            raise ValueError("context parallelism with a vision-language model is not supported yet (the image "
                             "features would have to follow each rank's share of the sequence); use cp=1")
        if config.freeze_vision:
            for model in models:
                if model.visual is not None:
                    model.visual.requires_grad_(False)
    if config.freeze_moe_router:
        if not spec.num_experts:
            raise ValueError("freeze_moe_router needs a MoE model; this one has no experts")
        for model in models:
            for name, param in model.named_parameters():
                if ".router." in name:  # decoder.layers.{i}.mlp.router.weight (and its expert bias)
                    param.requires_grad_(False)
    if role.output is Output.VALUES:
        for model in models:
            if model.post_process:
                model.output_layer = value_head(transformer_config)
    for model in models:
        if model.post_process:
            lm_head.install(model, spec.vocab_size)  # logits of the response rows and real tokens only
    if config.lora.enabled:
        for model in models:  # frozen base, trainable adapters: Megatron's DDP and optimizer take only the adapters
            lora.attach(model, config.lora)
    if dtype != torch.float32:
        models = [Float16Module(transformer_config, model) for model in models]
    if not role.trains:
        for model in models:
            model.requires_grad_(False)
        return models, transformer_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer(config.optimizer),
    )
    chunks = [DistributedDataParallel(transformer_config, ddp_config, model) for model in models]
    transformer_config.finalize_model_grads_func = finalize_model_grads
    transformer_config.no_sync_func = [chunk.no_sync for chunk in chunks] if len(chunks) > 1 else chunks[0].no_sync
    return chunks, transformer_config


def _check_router_replay(spec: ModelSpec, config: WorkerConfig, role: Role) -> None:
    if not spec.num_experts:
        raise ValueError(f"router_replay={config.router_replay} replays MoE routing; this model has no experts")
    if not role.replays_routing:
        raise ValueError(f"router_replay is for the actor (and reference); the {role.name} routes by itself")


def check_head(spec: ModelSpec, role: str) -> None:
    """Refuse a checkpoint whose output head cannot serve ``role``: log-probs need an LM head, a
    reward model one score per sequence (a single-label score head)."""
    from rlmega.models import ARCHITECTURES

    output = ROLES[role].output
    if output is Output.SCORES and (spec.score_head is None or spec.score_head.num_labels != 1):
        has = "an LM head" if spec.score_head is None else f"a score head of {spec.score_head.num_labels} labels"
        classifiers = ", ".join(name for name in ARCHITECTURES if name.endswith("ForSequenceClassification"))
        raise ValueError(f"the reward role needs a sequence-classification checkpoint with num_labels=1 "
                         f"({classifiers}); this {spec.architecture} has {has}")
    if output is Output.LOGITS and spec.score_head is not None:
        raise ValueError(f"the {role} computes log-probs and needs a causal LM; this {spec.architecture} has a "
                         "score head in place of the LM head (use it with role reward)")


def _untied(spec: ModelSpec) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, tie_word_embeddings=False)


def use_distributed_optimizer(config: OptimizerConfig) -> bool:
    if config.distributed_optimizer is None:
        return torch.cuda.is_available()  # gloo has no reduce-scatter
    return config.distributed_optimizer


def use_fused_cpu_adam(optimizer) -> int:
    """Step torch's Adam(W) with its fused kernel where its parameters are on the CPU. Megatron uses torch's
    optimizer when neither transformer-engine nor apex is installed, and torch defaults to its fused and
    foreach paths on GPUs only: on the CPU it steps each parameter through a dozen Python-level ops (9x slower
    on the quickstart's model). The same arithmetic, rounded the same up to an ulp. Call it again after a
    checkpoint load, which restores the saved param groups' settings. Returns the groups switched."""
    switched = 0
    for inner in sub_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            on_cpu = all(param.device.type == "cpu" for param in group["params"])
            if on_cpu and not group.get("fused") and not group.get("differentiable") and not group.get("capturable"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def build_optimizer(chunks: list, config: OptimizerConfig, dtype: torch.dtype, total_steps: int, *,
                    gloo_groups: bool = True):
    """Megatron's optimizer (Adam, fp32 master weights for bf16) and its LR / weight-decay schedule.
    ``gloo_groups=False`` where Megatron's gloo groups do not exist (the planner's fake process group);
    the distributed optimizer uses them only to save its state."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    offload = config.cpu_offload_fraction > 0
    if offload and not use_distributed_optimizer(config):
        raise ValueError("optimizer.cpu_offload_fraction needs the distributed optimizer (NCCL on GPUs; "
                         "optimizer.distributed_optimizer null or true), which this run does not use")
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.clip_grad, bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
            use_distributed_optimizer=use_distributed_optimizer(config),
            # Megatron's HybridDeviceOptimizer: that share of the state is kept and stepped on the CPU.
            optimizer_cpu_offload=offload, optimizer_offload_fraction=config.cpu_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=offload,
            # Without it the distributed optimizer makes fp32 master shards on the GPU, which the hybrid
            # optimizer copies to the host and never frees (4 bytes per owned element stay on the GPU);
            # with it the hybrid optimizer makes the fp32 masters from the bf16 shards itself, in host
            # memory for the offloaded share. Moments stay fp32; no transformer-engine needed when offloading.
            use_precision_aware_optimizer=offload,
        ),
        chunks,
        use_gloo_process_groups=gloo_groups,
    )
    use_fused_cpu_adam(optimizer)
    decay_steps = config.lr_decay_steps or total_steps
    if config.lr_schedule != "constant" and decay_steps <= config.lr_warmup_steps:
        raise ValueError(
            f"optimizer.lr_schedule={config.lr_schedule!r} decays over {decay_steps} steps, which must exceed "
            f"lr_warmup_steps={config.lr_warmup_steps}; set optimizer.lr_decay_steps or the total number of steps"
        )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps, lr_decay_steps=max(decay_steps, config.lr_warmup_steps + 1),
        lr_decay_style={"wsd": "WSD"}.get(config.lr_schedule, config.lr_schedule),
        start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        wsd_decay_steps=config.wsd_decay_steps if config.lr_schedule == "wsd" else None,
        lr_wsd_decay_style="linear" if config.lr_schedule == "wsd" else None,
    )
    return optimizer, scheduler

"""Typed settings of a Megatron worker. Each field is read in one place; defaults follow verl's where
they overlap, so recipes carry over."""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlmega.algos import (
    POLICY_LOSS_CONFIGS, BaseLossConfig, PolicyLoss, get_policy_loss_config, loss_option_types, loss_options,
)
from rlmega.models.lora import LoraConfig
from rlmega.workers.roles import ROLES

LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate (after warm-up)."""
    min_lr: float = 0.0
    """Floor of the decaying schedules."""
    lr_schedule: str = "constant"
    """constant | linear | cosine | wsd (warm-up, stable, then decay over ``wsd_decay_steps``)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    lr_decay_steps: Optional[int] = None
    """Steps over which the schedule decays to ``min_lr``; None: ``total_steps`` given to the worker."""
    wsd_decay_steps: int = 0
    """WSD only: the final steps of the decay phase."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""
    distributed_optimizer: Optional[bool] = None
    """Shard optimizer state over data-parallel ranks; None: on with NCCL, off with gloo (which has no
    reduce-scatter)."""
    cpu_offload_fraction: float = 0.0
    """Share of the optimizer state (fp32 master weights, Adam moments) kept and stepped in host memory
    (Megatron's ``optimizer_cpu_offload`` / ``optimizer_offload_fraction``): GPU memory for CPU time.
    Needs the distributed optimizer (NCCL, GPU); 0 keeps it on the GPU."""

    def __post_init__(self):
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optimizer.lr_schedule={self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optimizer needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if not 0 <= self.cpu_offload_fraction <= 1:
            raise ValueError(f"optimizer.cpu_offload_fraction must be in [0, 1], got {self.cpu_offload_fraction}")


@dataclasses.dataclass
class BatchingConfig:
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch on one rank (dynamic batch size); a longer sequence gets a
    micro-batch alone. Under context parallelism the cp ranks share micro-batches of cp times as many."""
    min_microbatches: int = 1
    """Use at least this many micro-batches per mini-batch (e.g. to fill a pipeline)."""
    packing: bool = True
    """Concatenate a micro-batch's sequences into one row (no padding in the forward); else right-pad. Without
    transformer-engine's THD attention (CPU), a micro-batch of nearly equal lengths (padding adds at most 10 %) is
    padded all the same, which is faster there (``batching.packs_better``)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when turning vocabulary-parallel logits into log-probs (bounds fp32 memory)."""

    def __post_init__(self):
        if self.max_tokens_per_microbatch < 1 or self.min_microbatches < 1:
            raise ValueError("batching.max_tokens_per_microbatch and batching.min_microbatches must be >= 1")


# The YAML section is flat (OmegaConf has no tagged unions): one field per option of any loss, None
# meaning the chosen loss's own default. An option added to a loss's config appears here by itself.
_LossParameters = dataclasses.make_dataclass("_LossParameters", [
    (name, kind, dataclasses.field(default=None)) for name, kind in loss_option_types(POLICY_LOSS_CONFIGS.values()).items()
], namespace={"__module__": __name__})
# Loss parameters the config passes by name when set (see PolicyLossConfig.loss_config).
LOSS_PARAMETERS = tuple(field.name for field in dataclasses.fields(_LossParameters))


@dataclasses.dataclass
class PolicyLossConfig(_LossParameters):
    """The actor's loss: a policy loss of ``rlmega.algos.POLICY_LOSS_CONFIGS`` by name, its parameters,
    and the entropy and KL terms. The parameters (``LOSS_PARAMETERS``: clip_ratio_low, tau_pos, ...)
    are the options of the losses' own configs (``PPOLossConfig``, ``SAPOLossConfig``, ...), which
    document each one. A parameter left at None takes the chosen loss's own default (PPO's clip range
    is 0.2, GSPO's 3e-4 / 4e-4); setting one the chosen loss does not take is refused."""

    name: str = "ppo"
    """A key of ``rlmega.algos.POLICY_LOSS_CONFIGS`` (ppo, vanilla, clip_higher, dual_clip, gspo, cispo, sapo,
    clip_cov, kl_cov, geo_mean, gpg, reinforce)."""
    clamp_log_ratio: bool = True
    """Clamp ``logp - old_logp`` before exponentiating (verl's ±20; GSPO's sequence ratio ±10), so one
    token with a huge ratio cannot overflow the loss; False turns the clamp off (``log_ratio_clamp``
    sets its bound)."""
    loss_agg_mode: str = "token-mean"
    norm_horizon: Optional[float] = None
    """Constant H of ``seq-mean-token-sum-norm`` (e.g. the max response length)."""
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    """Coefficient of the KL-to-reference loss (GRPO); 0 disables it and the reference is not needed."""
    kl_estimator: str = "low_var_kl"
    """A key of ``rlmega.algos.KL_ESTIMATORS``: the estimator of the KL loss, and of the KL in the
    reward (``algorithm.kl_in_reward_coef``)."""

    def loss_config(self) -> BaseLossConfig:
        """The chosen loss's own config, with the parameters this config sets (None fields are left to the loss)."""
        config_class = get_policy_loss_config(self.name)
        accepted = loss_options(config_class)
        settings = {name: getattr(self, name) for name in LOSS_PARAMETERS if getattr(self, name) is not None}
        unknown = sorted(set(settings) - set(accepted))
        if unknown:
            raise ValueError(f"policy_loss.{unknown[0]} is not a parameter of policy loss {self.name!r} "
                             f"(it takes {', '.join(accepted) or 'none of them'}); "
                             f"unset it with policy_loss.{unknown[0]}=null")
        if "log_ratio_clamp" in accepted and not self.clamp_log_ratio:
            settings["log_ratio_clamp"] = None
        return config_class(loss_agg_mode=self.loss_agg_mode, norm_horizon=self.norm_horizon, **settings)

    def build(self) -> PolicyLoss:
        """The chosen loss, built: ``loss(logp, old_logp, advantages, mask, context) -> (loss, metrics)``."""
        return self.loss_config().build()


@dataclasses.dataclass
class CriticLossConfig:
    cliprange_value: Optional[float] = 0.5
    """Clip the new value to ``old_value +- cliprange_value`` (PPO value clipping); None disables."""
    loss_agg_mode: str = "token-mean"


@dataclasses.dataclass
class WorkerConfig:
    role: str = "actor"
    """actor: log-probs and policy updates; ref: log-probs only; critic: values and value updates;
    reward: a sequence-classification reward model's scores only; teacher: a frozen teacher's log-probs and top-k
    tokens (on-policy distillation)."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    policy_loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    critic_loss: CriticLossConfig = dataclasses.field(default_factory=CriticLossConfig)
    ppo_epochs: int = 1
    """Passes over each batch in ``update``."""
    ppo_mini_batches: int = 1
    """Optimizer steps per epoch: the batch is split into this many mini-batches."""
    dtype: Optional[str] = None
    """bf16 | fp32; None: bf16 with CUDA, fp32 on CPU."""
    sequence_parallel: Optional[bool] = None
    """None: on when tp > 1 on GPUs (less activation memory) and for MoE models (Megatron requires it with
    tp > 1); off for dense models on CPU, where gloo's all-gathers and reduce-scatters cost more than the
    norms they split (the tiny CPU job's TP2 update: 84 ms with, 64 ms without). See ``uses_sequence_parallel``."""
    offload: bool = False
    """Keep parameters (and gradients, optimizer state) in host memory between calls; for a reference
    model, or when training shares devices with rollout engines."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation (Megatron's): None keeps every activation; ``full`` recomputes whole
    layers in the backward pass (the least memory); ``selective`` recomputes only ``recompute_modules``."""
    recompute_method: Optional[str] = None
    """``full`` only: ``uniform`` (default) checkpoints units of ``recompute_num_layers`` layers;
    ``block`` recomputes the first ``recompute_num_layers`` layers of each pipeline stage only."""
    recompute_num_layers: Optional[int] = None
    """``full`` only: layers per unit (uniform, default 1) or per stage (block)."""
    recompute_modules: Optional[list[str]] = None
    """``selective`` only: any of core_attn, mlp, moe, shared_experts, layernorm, mla_up_proj, moe_act
    (Megatron's default: ["core_attn"])."""
    activation_offload_layers: int = 0
    """Offload the activations of this many layers to host memory during the forward pass
    (Megatron's ``cpu_offloading``; CUDA only, no pipeline parallelism, not with recomputation)."""
    freeze_moe_router: bool = False
    """Keep the MoE routers' weights fixed (no gradient, not updated): a common choice for RL on MoE
    models, whose routing otherwise drifts between rollout and training."""
    freeze_vision: bool = True
    """A vision-language model's vision tower (patch embedding, blocks, merger) stays fixed: the common choice
    in RL, where the language model learns to read what the tower sees."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """The actor only: train low-rank adapters on the linear layers over frozen base weights (``lora.rank > 0``);
    the reference log-probs then come from the actor with its adapters off (``rlmega.models.lora``)."""
    router_replay: str = "none"
    """MoE routing replay (``rlmega.workers.routing``): ``none``; ``r2``: the old-log-prob pass records
    every token's experts and the update replays them; ``r3``: the batch's routing (from the rollout
    engine) is replayed in both."""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"worker role {self.role!r} must be one of {', '.join(ROLES)}")
        if self.ppo_epochs < 1 or self.ppo_mini_batches < 1:
            raise ValueError("ppo_epochs and ppo_mini_batches must be >= 1")
        if self.dtype not in (None, "bf16", "fp32"):
            raise ValueError(f"worker dtype {self.dtype!r} must be bf16, fp32 or None (automatic)")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r} must be full, selective or None")
        if self.recompute_granularity != "full" and (self.recompute_method or self.recompute_num_layers):
            raise ValueError("recompute_method and recompute_num_layers need recompute_granularity=full")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ValueError(f"recompute_method={self.recompute_method!r} must be uniform or block")
        if self.recompute_modules is not None and self.recompute_granularity != "selective":
            raise ValueError("recompute_modules needs recompute_granularity=selective")
        if self.activation_offload_layers < 0:
            raise ValueError(f"activation_offload_layers must be >= 0, got {self.activation_offload_layers}")
        if self.router_replay not in ("none", "r2", "r3"):
            raise ValueError(f"router_replay={self.router_replay!r} must be none, r2 or r3")
        self.lora.check(f"{self.role}.lora")
        if self.lora.enabled and self.role != "actor":
            raise ValueError(f"{self.role}.lora: LoRA adapters are for the actor; set {self.role}.lora.rank=0")
        if self.activation_offload_layers and self.recompute_granularity:
            raise ValueError("activation_offload_layers and recompute_granularity exclude each other (Megatron's rule)")

    def uses_sequence_parallel(self, tp: int, *, moe: bool, gpu: bool) -> bool:
        """``sequence_parallel``, or its default for ``tp`` ranks, a MoE model or not, on GPUs or on CPU."""
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return tp > 1 and (gpu or moe)

    def memory_settings(self) -> dict:
        """The ``TransformerConfig`` fields of the recomputation and activation-offload settings."""
        settings: dict = {}
        if self.recompute_granularity == "full":
            settings.update(recompute_granularity="full", recompute_method=self.recompute_method or "uniform",
                            recompute_num_layers=self.recompute_num_layers or 1)
        elif self.recompute_granularity == "selective":
            settings.update(recompute_granularity="selective", recompute_modules=self.recompute_modules)
        if self.activation_offload_layers:
            settings.update(cpu_offloading=True, cpu_offloading_num_layers=self.activation_offload_layers,
                            cpu_offloading_activations=True, cpu_offloading_weights=False)
        return settings

    @property
    def trains(self) -> bool:
        return ROLES[self.role].trains

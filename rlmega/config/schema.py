"""The one typed configuration tree of an RL run.

YAML files in ``configs/`` only override these defaults, and command-line overrides (Hydra syntax)
override both. Each component keeps its own small config next to its code (workers, data,
rewards, metrics); this module gathers them and adds the ones that belong to the run.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from rlmega.agent.config import AgentConfig
from rlmega.gateway.config import GatewayConfig
from rlmega.algos.distill import DistillConfig
from rlmega.algos.rollout_correction import RolloutCorrectionConfig
from rlmega.data import DataConfig
from rlmega.parallel.layout import LayoutConfig
from rlmega.plan.config import PlanConfig
from rlmega.rewards import RewardConfig
from rlmega.rewards.judge import DEFAULT_TEMPLATE as DEFAULT_JUDGE_TEMPLATE
from rlmega.sync.config import SyncConfig
from rlmega.workers.config import BatchingConfig, WorkerConfig

METRIC_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def choice(default: str, *options: str):
    """A field that takes one of ``options``; ``validate`` checks every such field of the tree by
    this declaration, naming the field and the valid values."""
    return dataclasses.field(default=default, metadata={"choices": (default, *options)})


@dataclasses.dataclass
class ModelConfig:
    path: str = "???"
    """HF checkpoint directory (config.json, safetensors, tokenizer files) the run starts from."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory when it is not ``path``."""
    mtp: str = choice("auto", "on", "off")
    """Multi-token-prediction layers config.json announces (DeepSeek-V3's num_nextn_predict_layers): on builds
    and trains them, off leaves them out (and their weights unread), auto builds them when the checkpoint
    holds their weights (or no weights at all, as for ``rlmega plan``) and says so when it does not. In YAML
    write "off" in quotes (a bare off reads as false)."""


@dataclasses.dataclass
class RolloutConfig:
    backend: str = choice("hf", "vllm", "sglang")
    """hf (transformers, CPU or GPU); vllm and sglang on GPU."""
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other constructor arguments of the engine, passed as they are (e.g. vLLM's ``enforce_eager``);
    the settings below have fields of their own and may not be set here."""
    gpu_memory_utilization: float = 0.5
    """Share of each engine GPU's memory the engine may take for weights and KV cache (vLLM's
    ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``); unused by the hf engine."""
    tensor_parallel_size: int = 1
    """GPUs one engine splits each layer over (vLLM ``tensor_parallel_size``, SGLang ``tp_size``)."""
    data_parallel_size: int = 1
    """Replicas inside one engine (vLLM ``data_parallel_size``, SGLang ``dp_size``)."""
    expert_parallel_size: int = 1
    """MoE experts split over this many of the engine's GPUs (SGLang ``ep_size``; vLLM's expert
    parallelism spans tensor x data parallel ranks, so > 1 turns on its ``enable_expert_parallel``)."""
    max_num_batched_tokens: Optional[int] = None
    """Tokens per engine scheduling step (vLLM ``max_num_batched_tokens``, SGLang ``max_prefill_tokens``);
    None: the engine's default."""
    weight_dtype: str = choice("auto", "fp8")
    """auto: the engines serve the weights in their compute dtype. fp8: they serve every linear weight as
    blockwise FP8 (128 x 128 blocks with fp32 scales, DeepSeek-V3's format; norms, embeddings, routers and the
    LM head stay as they are), about halving the engines' weight memory, at a larger train-inference mismatch
    (see rlmega/trainer/README.md, FP8 rollout). The hf engine dequantizes for its computation."""
    num_engines: int = 1
    placement: str = choice("colocated", "disaggregated")
    """colocated: engines share the training ranks' resources and sleep while training runs (training
    offloads while engines generate); disaggregated: engines have resources of their own."""
    colocated_offload: str = choice("auto", "always", "never")
    """Colocated: whether training state moves to host memory while engines generate, and engines sleep
    while training runs. auto: when either holds GPU memory (``cluster.gpus_per_rank`` or
    ``rollout.gpus_per_engine`` > 0, or a vLLM / SGLang engine); on CPU both already live in host memory, so
    the moves would only cost time; always; never (GPU memory enough for both at once; the planner counts
    both in every phase)."""
    engine_spread: str = choice("pack", "spread")
    """pack: engines on as few nodes as possible; spread: one per node where possible."""
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0
    n: int = 4
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    max_new_tokens: int = 256
    val_temperature: float = 0.0
    """Validation's sampling temperature; 0: greedy validation (verl's ``val_kwargs.do_sample=false``)."""
    val_top_p: Optional[float] = None
    """Validation's top-p when it samples (``val_temperature`` > 0); None: ``top_p``, as training samples."""
    val_top_k: Optional[int] = None
    """Validation's top-k when it samples; None: ``top_k``, as training samples (set 0 or -1 for none at all)."""
    val_n: int = 1
    """Responses per validation prompt; the scores are averaged over all of them, and with more than one,
    ``val/pass@{val_n}`` counts the prompts with at least one correct response (verl's ``val_kwargs.n``)."""
    mode: str = choice("sync", "one_step_off", "async")
    """sync: generate, train, sync the weights, in turn. one_step_off: the engines generate the next step's
    responses while the workers train this one, from the weights this step trains from (exactly one
    version stale). async: the engines generate continuously into a buffer of whole groups and the trainer
    takes a batch when it has enough (``max_staleness``). Both overlapping modes need disaggregated engines;
    see rlmega/trainer/README.md (Asynchronous rollout)."""
    max_staleness: int = 1
    """async: a group is trained on only if the oldest weight version among its tokens is at most this
    many versions behind the policy being updated; the engines are also given no more prompts than that
    bound lets them finish in time (0: on-policy, but still overlapped with the weight sync)."""
    stale_groups: str = choice("regenerate", "drop")
    """async: what happens to a group found staler than ``max_staleness``: generated again with the
    current weights (its prompt is not lost), or dropped (counted either way)."""
    partial_rollout: str = choice("continue", "restart")
    """async: responses in flight when new weights arrive are interrupted; ``continue`` carries on with the
    new weights from where they stopped (each token records the version that produced it), ``restart``
    throws the partial response away and generates it again."""
    restart_dead_engines: int = 0
    """An engine that dies in a request (killed, out of memory, crashed) is started again on its resources, given the
    current weights through the weight sync and checked (the post-sync check), and the requests it had in flight
    are submitted again; this many times per engine within ``restart_window_steps`` steps, and one more death
    stops the run naming the engine and its restarts. 0: a dead engine stops the run. Needs engines in processes
    of their own (Ray; a run in one process goes on Ray) and ``mode`` sync or async; see rlmega/trainer/README.md
    (Engine restarts)."""
    restart_window_steps: int = 100
    """The window of ``restart_dead_engines``, in training steps: an engine's restarts count for this many steps."""

    @property
    def gpus_of_one_engine(self) -> int:
        """The GPUs one engine runs on: its tensor x data parallel size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def computes_in_fp32(self) -> bool:
        """Whether the engines compute in fp32: ``engine_kwargs.dtype`` when given; else the hf engine on CPU
        does, and vLLM / SGLang on their "auto" dtype do not (both serve a float32 checkpoint in bf16)."""
        dtype = self.engine_kwargs.get("dtype")
        if dtype is None:
            return self.backend == "hf" and self.gpus_per_engine == 0
        return str(dtype).removeprefix("torch.") in ("float32", "fp32", "float")

    def engine_arguments(self) -> dict:
        """The backend's constructor arguments: the engine-level fields above under the backend's own
        names (``ENGINE_ARGUMENTS``), then ``engine_kwargs``, which may not repeat them."""
        if "weight_dtype" in self.engine_kwargs:
            raise ValueError("rollout.engine_kwargs.weight_dtype: set rollout.weight_dtype instead")
        fp8 = {"weight_dtype": "fp8"} if self.weight_dtype == "fp8" else {}
        if self.backend == "hf":
            return {**self.engine_kwargs, **fp8}
        names = ENGINE_ARGUMENTS[self.backend]
        arguments = {name: getattr(self, field) for field, name in names.items() if getattr(self, field) is not None}
        if self.backend == "vllm" and self.expert_parallel_size > 1:
            arguments["enable_expert_parallel"] = True  # vLLM's experts then split over its tp x dp ranks
        for key in self.engine_kwargs:
            field = next((f for f, name in names.items() if name == key), None)
            if field is not None or key == "enable_expert_parallel":
                raise ValueError(f"rollout.engine_kwargs.{key}: set rollout.{field or 'expert_parallel_size'} instead")
        return {**arguments, **self.engine_kwargs, **fp8}


# RolloutConfig's engine-level fields under each backend's argument names.
ENGINE_ARGUMENTS = {
    "vllm": {"gpu_memory_utilization": "gpu_memory_utilization", "tensor_parallel_size": "tensor_parallel_size",
             "data_parallel_size": "data_parallel_size", "max_num_batched_tokens": "max_num_batched_tokens"},
    "sglang": {"gpu_memory_utilization": "mem_fraction_static", "tensor_parallel_size": "tp_size",
               "data_parallel_size": "dp_size", "expert_parallel_size": "ep_size",
               "max_num_batched_tokens": "max_prefill_tokens"},
}


@dataclasses.dataclass
class RewardModelConfig:
    """A discriminative reward model on Megatron ranks of its own (verl's ``reward_model``): an HF
    ``*ForSequenceClassification`` checkpoint (num_labels=1) loaded through the bridge, scoring prompt +
    response at its last non-pad token; the reward manager's ``reward_model`` component
    (``reward.weights``). See rlmega/trainer/README.md (Reward models)."""

    enable: bool = False
    path: Optional[str] = None
    """The reward model's HF checkpoint directory."""
    tokenizer_path: Optional[str] = None
    """The reward model's tokenizer (verl's ``input_tokenizer`` is the policy's); None: ``path``'s."""
    chat_template: Optional[str] = None
    """A Jinja chat template for the reward model's input, in place of its tokenizer's."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra variables for that chat template."""
    retokenize: str = choice("auto", "always", "never")
    """auto: score the policy's token ids as they are when the reward tokenizer and chat template are the
    policy's, else decode the response and render the prompt's messages + the response with the reward
    model's template and tokenizer; always / never: one of the two whatever the tokenizers."""
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    """The reward model's own parallel layout and world size (``layout.world_size`` ranks of its own)."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    offload: bool = False
    """Keep the weights in host memory between scoring calls."""
    dtype: Optional[str] = None
    """bf16 | fp32; None: bf16 with CUDA, fp32 on CPU."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward micro-batch on one rank (verl's ``forward_max_token_len_per_gpu``)."""
    normalize: str = choice("none", "batch", "running")
    """Normalise the scores before they are weighted: batch z-score, or by the running mean and std of all
    training scores so far (not restored on resume)."""
    clip_range: Optional[list[float]] = None
    """``[low, high]``: clamp the (normalised) scores to it; None: no clipping."""

    def worker_config(self) -> WorkerConfig:
        """The Megatron worker of every reward-model rank."""
        return WorkerConfig(role="reward", dtype=self.dtype, offload=self.offload,
                            batching=BatchingConfig(max_tokens_per_microbatch=self.max_tokens_per_microbatch))


@dataclasses.dataclass
class TeacherModelConfig:
    """One frozen teacher model on Megatron ranks of its own: its checkpoint, layout and resources."""

    path: Optional[str] = None
    """The teacher's HF checkpoint directory (a causal LM with the student's vocabulary)."""
    tokenizer_path: Optional[str] = None
    """The teacher's tokenizer, checked to equal the student's; None: ``path``'s."""
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    """The teacher's own parallel layout and world size (``layout.world_size`` ranks of its own; a larger
    model than the student's takes a larger tp or pp)."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    """A fraction shares the GPUs of the actor's ranks (colocated); 1 gives each rank a GPU of its own."""
    offload: bool = False
    """Keep the weights in host memory between calls (they come onto the device for each pass)."""
    dtype: Optional[str] = None
    """bf16 | fp32; None: bf16 with CUDA, fp32 on CPU."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward micro-batch on one rank."""

    def worker_config(self) -> WorkerConfig:
        """The Megatron worker of every rank of this teacher."""
        return WorkerConfig(role="teacher", dtype=self.dtype, offload=self.offload,
                            batching=BatchingConfig(max_tokens_per_microbatch=self.max_tokens_per_microbatch))


@dataclasses.dataclass
class TeacherConfig(TeacherModelConfig):
    """On-policy distillation's frozen teacher (``algorithm.distill``): it scores the student's own response
    tokens, log-probs of the sampled tokens and, with ``top_k``, its most likely tokens at each position. Its
    tokenizer must be the student's. See rlmega/trainer/README.md (On-policy distillation: the teacher)."""

    enable: bool = False
    top_k: int = 0
    """0: the teacher gives the log-probs of the sampled tokens only; k > 0: also the ids and log-probs of its k
    most likely tokens at every response position."""
    per_data_source: dict[str, TeacherModelConfig] = dataclasses.field(default_factory=dict)
    """Several teachers: examples whose ``data_source`` has an entry here are scored by that teacher (ranks of its
    own), the others by the main one above (multi-teacher distillation, as NeMo-RL's MOPD)."""

    def models(self) -> dict[Optional[str], TeacherModelConfig]:
        """Every teacher to start: None for the main one, then one per data source."""
        return {None: self, **self.per_data_source}


@dataclasses.dataclass
class JudgeConfig:
    """A generative judge: rollout engines of their own serving ``path``, asked with ``prompt_template``
    to grade each response; ``parser`` turns the answer into the reward manager's ``judge`` score
    (``rlmega.rewards.judge``)."""

    enable: bool = False
    backend: str = choice("hf", "vllm", "sglang")
    path: Optional[str] = None
    """The judge's HF checkpoint directory (a causal LM)."""
    tokenizer_path: Optional[str] = None
    """None: ``path``'s tokenizer."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt, with any of ``{question}``, ``{response}``, ``{ground_truth}``, ``{data_source}``."""
    use_chat_template: bool = True
    """Give the prompt as a user message through the judge tokenizer's chat template (when it has one)."""
    parser: Optional[str] = None
    """``path/to/file.py:function``: ``function(text)`` returns the score of the judge's answer (a number, or a
    dict with a numeric ``score``); None: the first number in the answer. A parser that raises scores 0."""
    response_length: int = 16
    """The longest answer of the judge, in tokens (verl's ``response_length``)."""
    temperature: float = 0.0
    """0: greedy."""
    num_engines: int = 1
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other constructor arguments of the judge's engines, as for ``rollout.engine_kwargs``."""
    normalize: str = choice("none", "batch", "running")
    """As ``reward_model.normalize``, for the judge's scores."""
    clip_range: Optional[list[float]] = None

    def engine_config(self) -> RolloutConfig:
        """The judge's engines as a rollout config (what ``RolloutGroup`` starts)."""
        return RolloutConfig(backend=self.backend, engine_kwargs=dict(self.engine_kwargs), num_engines=self.num_engines,
                             gpu_memory_utilization=self.gpu_memory_utilization,
                             tensor_parallel_size=self.tensor_parallel_size, placement="disaggregated",
                             cpus_per_engine=self.cpus_per_engine, gpus_per_engine=self.gpus_per_engine)


POST_SYNC_ATOL_FP32 = 1e-3
POST_SYNC_ATOL_BF16 = 0.5
# FP8 engines: e4m3 keeps 3 mantissa bits; the quickstart's greedy probes move by 0.07-0.08 with the weights alone
# in FP8, and GPU engines also quantize activations. A wrong mapping moves them by several nats.
POST_SYNC_ATOL_FP8 = 1.0


@dataclasses.dataclass
class AlgorithmConfig:
    """How scored responses become advantages (the policy loss itself is ``actor.policy_loss``)."""

    adv_estimator: str = "grpo"
    """A key of ``rlmega.algos.ADVANTAGE_ESTIMATORS`` (gae, grpo, dr_grpo, grpo_passk, gpg, rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline, remax); gae trains a critic, remax generates a
    greedy baseline response per prompt."""
    norm_adv_by_std: bool = True
    """grpo-style estimators: divide group-centred scores by the group's std (False: Dr. GRPO)."""
    gamma: float = 1.0
    lam: float = 1.0
    """GAE lambda (gae)."""
    kl_in_reward_coef: float = 0.0
    """Subtract ``coef * KL(actor || ref)`` (estimator ``actor.policy_loss.kl_estimator``) from the
    token rewards (needs the reference); outcome estimators then see each response's summed reward."""
    dynamic_sampling: bool = False
    """DAPO: drop prompt groups whose ``dynamic_sampling_metric`` is equal over the group and generate more until
    the batch is full."""
    dynamic_sampling_metric: str = "shaped_score"
    """The per-response value dynamic sampling compares within a group: ``shaped_score`` (the score after DAPO's
    overlong shaping, what the advantages see; verl's ``seq_reward``), ``score`` (the reward before that shaping),
    or the name of any number the reward function returns beside its score (``{"score": ..., "acc": ...}``: ``acc``,
    as in verl's DAPO recipe). ``acc`` of a reward that gives no other number (a plain number, as rlmega's rule
    scorers return) is its score, as verl's DAPO reward manager records it; another name that a response's
    reward lacks stops the step, naming the keys it gave. A response whose scoring failed counts 0."""
    max_generation_rounds: int = 3
    """DAPO dynamic sampling: at most this many generation rounds per step."""
    overlong_buffer_length: int = 0
    """DAPO soft overlong penalty over the last tokens of ``rollout.max_new_tokens``; 0 disables."""
    overlong_penalty_factor: float = 1.0
    filter_truncated: bool = False
    """DAPO overlong filtering: responses that hit the length limit do not count in the loss."""
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """Train-inference mismatch: importance weights and rejection from the engine's log-probs."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """On-policy distillation: the student's per-token reverse KL to the teacher (``teacher``), in the advantages
    or as a loss term; off by default (``coef: 0``)."""


@dataclasses.dataclass
class TrainerConfig:
    total_steps: int = 100
    """RL steps of the run (unless ``total_epochs`` is set)."""
    total_epochs: Optional[int] = None
    """Passes over the training prompts; when set, it decides the number of steps
    (``total_epochs * floor(prompts / prompts_per_step)``) and ``total_steps`` is not used."""
    prompts_per_step: int = 32
    """Prompts per step (responses per step = prompts_per_step * rollout.n)."""
    save_every: int = 0
    """Checkpoint every N steps (and at the end); 0: only at the end."""
    max_checkpoints_to_keep: Optional[int] = None
    """Keep only the newest k complete checkpoints of each role (older ones are deleted after a new
    one is complete; the newest is never deleted); None: keep all."""
    val_every: int = 0
    """Validate every N steps (and after the last); 0: never."""
    val_before_train: bool = True
    """With ``val_every``, also validate before the first step (not after a resume)."""
    val_prompts: int = 64
    """Validation prompts (the first ones of the validation files)."""
    log_val_generations: int = 0
    """Show this many validation prompts with their responses and scores at every validation: on the
    console, in ``run_dir/generations.jsonl``, and as a text table in TensorBoard / W&B / MLflow."""
    critic_warmup: int = 0
    """PPO: the first N steps train only the critic (the actor is not updated)."""
    fuse_old_logprob: bool = True
    """When a batch gets exactly one optimizer step (``actor.ppo_epochs=1``, ``actor.ppo_mini_batches=1``)
    and nothing needs the old log-probs before the update (no rollout correction, no KL in the reward),
    take them from the update's own forward pass instead of a separate one (the same gradient)."""
    seed: int = 1
    sft_steps: int = 0
    """Supervised warm-start steps on the training data's ground truths before RL (tiny models)."""
    sft_lr: float = 1e-3


@dataclasses.dataclass
class MetricsConfig:
    backends: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    """Where metrics go, any of: console, jsonl, tensorboard, wandb, mlflow."""
    project: str = "rlmega"
    """W&B project / MLflow experiment the run belongs to."""
    experiment_name: str = "run"
    """Name of this run in W&B and MLflow, and the title of the reward-curve plot."""
    console_every: int = 1
    """Print the console metrics line every this many steps (the progress bar moves every step)."""
    plot: bool = True
    """Write run_dir/reward_curve.png at each validation and at close (needs matplotlib)."""

    def __post_init__(self):
        self.backends = list(self.backends)
        unknown = [b for b in self.backends if b not in METRIC_BACKENDS]
        if unknown:
            raise ValueError(f"MetricsConfig.backends: unknown {unknown}; valid backends: {', '.join(METRIC_BACKENDS)}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"MetricsConfig.backends: {self.backends} names a backend twice")
        if self.console_every < 1:
            raise ValueError(f"MetricsConfig.console_every must be >= 1, got {self.console_every}")


@dataclasses.dataclass
class ClusterConfig:
    ray_address: Optional[str] = None
    """None: start a local Ray; "auto" or an address: join that cluster (RAY_ADDRESS also works)."""
    connect_timeout_s: float = 30.0
    """Longest wait for a Ray head to answer at ``ray_address`` before the run stops with one line saying none
    does (Ray itself would retry for many minutes without a word)."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    timeout_s: float = 600.0
    """Longest wait for any remote call before the run stops naming the worker."""
    in_process: str = choice("auto", "always", "never")
    """Run without Ray (``rlmega/trainer/in_process.py``): training rank 0 and the rollout engine in the driver's
    process, ranks 1..N-1 as its child processes; one colocated hf engine on CPU, synchronous rollout, no
    reward-model ranks or judge engines, no cluster to join. auto: whenever the run is such a run;
    always: refuse one that is not, naming why; never: Ray actors always."""


@dataclasses.dataclass
class RLConfig:
    run_dir: str = "runs/rlmega"
    """Everything the run writes: checkpoints/, metrics.jsonl, placement.json, reward_curve.png, hf/."""
    resume: str = choice("auto", "never")
    """auto: continue from the newest complete checkpoint in run_dir if any (refused when the settings changed what
    is trained; rlmega/trainer/README.md, How resume decides); never: start afresh."""
    overwrite: bool = False
    """With ``resume=never``: replace the checkpoints already in run_dir (at the new run's first save); without it
    such a run is refused. ``rlmega train --overwrite`` sets it."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    val_data: DataConfig = dataclasses.field(default_factory=DataConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """On-policy distillation's teacher model(s), on ranks of their own; off by default."""
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    actor: WorkerConfig = dataclasses.field(default_factory=lambda: WorkerConfig(role="actor"))
    ref: WorkerConfig = dataclasses.field(default_factory=lambda: WorkerConfig(role="ref", offload=True))
    critic: WorkerConfig = dataclasses.field(default_factory=lambda: WorkerConfig(role="critic"))
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    """Multi-turn rollouts with tool calls and environments (rlmega/agent/README.md); off by default."""
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    """Rollouts made by an agent harness written for the ``openai`` client, through the OpenAI-compatible gateway
    (rlmega/gateway/README.md); off by default."""
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    """The hardware ``rlmega plan`` checks the run against (GPU, nodes, links); the trainer does not read it."""
    export_hf: bool = True
    """Write the final weights as an HF checkpoint to run_dir/hf."""
    tiny_assets: bool = False
    """Build the quickstart's tiny model, tokenizer and arithmetic data under run_dir/assets if missing."""
    tiny_assets_max_operand: int = 9
    """With ``tiny_assets``: the arithmetic data's largest operand (9: single digits)."""
    tiny_vision: bool = False
    """With ``tiny_assets``: build a tiny vision-language model (Qwen2.5-VL) and a colour-naming task on images
    instead (``configs/tiny_cpu_vlm.yaml``)."""
    tiny_reward_model: bool = False
    """With ``tiny_assets``: also fit the quickstart's tiny reward model to the rule reward of the training
    prompts, into run_dir/assets/reward_model, if missing (``configs/tiny_cpu_rm.yaml``)."""
    tiny_teacher: bool = False
    """With ``tiny_assets``: also train the quickstart's tiny teacher (4 layers, the tiny policy's width and
    tokenizer) on the training prompts' answers, into ``teacher.path`` (``${run_dir}/assets/teacher``), if missing."""

    def post_sync_atol(self) -> float:
        """The post-sync check's tolerance: ``sync.post_sync_atol``, or the one of the run's precision."""
        if self.sync.post_sync_atol is not None:
            return self.sync.post_sync_atol
        if self.rollout.weight_dtype == "fp8":
            return POST_SYNC_ATOL_FP8
        actor_fp32 = self.actor.dtype == "fp32" or (self.actor.dtype is None and self.cluster.gpus_per_rank == 0)
        return POST_SYNC_ATOL_FP32 if actor_fp32 and self.rollout.computes_in_fp32() else POST_SYNC_ATOL_BF16

    @property
    def needs_reference(self) -> bool:
        return self.actor.policy_loss.kl_loss_coef > 0 or self.algorithm.kl_in_reward_coef > 0

    @property
    def builds_reference_model(self) -> bool:
        """A reference model of its own: a KL term needs reference log-probs and the actor has no LoRA adapters (a
        LoRA actor's reference is itself with its adapters off)."""
        return self.needs_reference and not self.actor.lora.enabled

    @property
    def needs_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    def in_process_obstacles(self) -> list[str]:
        """What keeps this run from starting in one process (``cluster.in_process``; empty: nothing)."""
        rollout = self.rollout
        obstacles = []
        if rollout.backend != "hf":
            obstacles.append(f"rollout.backend={rollout.backend} (the transformers engine only)")
        if rollout.num_engines != 1:
            obstacles.append(f"rollout.num_engines={rollout.num_engines} (one engine only)")
        if rollout.placement != "colocated":
            obstacles.append(f"rollout.placement={rollout.placement} (colocated only)")
        if rollout.mode != "sync":
            obstacles.append(f"rollout.mode={rollout.mode} (generation and training take turns in one process)")
        if rollout.restart_dead_engines:
            obstacles.append(f"rollout.restart_dead_engines={rollout.restart_dead_engines} (an engine is restarted in "
                             "a process of its own; one in the driver's process that dies takes the driver with it)")
        if self.cluster.gpus_per_rank > 0 or rollout.gpus_per_engine > 0:
            obstacles.append("GPUs (cluster.gpus_per_rank, rollout.gpus_per_engine): CPU runs only, for now")
        if self.reward_model.enable:
            obstacles.append("reward_model.enable (the reward model has ranks of its own)")
        if self.judge.enable:
            obstacles.append("judge.enable (the judge has engines of its own)")
        if self.teacher.enable:
            obstacles.append("teacher.enable (the teacher has ranks of its own)")
        if self.cluster.ray_address or os.environ.get("RAY_ADDRESS"):
            obstacles.append("a Ray cluster to join (cluster.ray_address or RAY_ADDRESS)")
        return obstacles

"""Low-rank adapters (LoRA) on a Megatron model's linear layers, sharded with their base layer.

An adapted layer computes ``W x + scale * B (A dropout(x))`` with ``A [r, in]``, ``B [out, r]`` and
``scale = alpha / r``; the base weight ``W`` is frozen, ``B`` starts at zero (the adapted model starts as the base
model), ``A`` at small random values. Dropout (PEFT's ``lora_dropout``) acts in training passes only: passes without
gradients (log-probs) and the merged weight ``W + scale * B @ A`` never drop. Tensor parallelism splits the adapter
as it splits the base layer:

- column parallel (``linear_qkv``, ``linear_fc1``; output rows split): ``B`` is split on its rows like ``W``, ``A`` is
  whole on every TP rank. The rank-r activation ``A x`` is whole everywhere; its gradient is summed over the TP ranks
  (each holds the part from its own rows of ``B``) so that ``A``'s gradient is the same on every rank.
- row parallel (``linear_proj``, ``linear_fc2``; input columns split): ``A`` is split on its columns like ``W``,
  ``B`` is whole. ``A x`` is summed over the TP ranks (an all-reduce of ``r`` values per token), then ``B`` applies.

Under sequence parallelism a column-parallel adapter gathers the sequence as its base layer does, and ``A``'s
gradient, partial per rank, is summed by Megatron's own all-reduce of sequence-parallel parameters; a row-parallel
adapter keeps its rank's share of the sequence. The merged weight of a TP shard is ``W_shard + scale * B_s @ A_s``
with both factors local, so merging needs no communication (``effective_weight``).

Experts (``experts.linear_fc1`` / ``experts.linear_fc2`` in ``target_modules``; the plain names are the dense MLP
and attention): each of Megatron's ``SequentialMLP`` experts gets its own pair, held by the expert-parallel rank that
holds the expert and split over expert-TP ranks like the expert's weights. The token dispatcher hands every expert-TP
rank the same tokens and sums their outputs, so an expert's adapter exchanges no activations: each rank adds its
partial product, and the gradient of the factor that is whole on every expert-TP rank (partial per rank) is summed
over them in the backward pass. Expert adapters are marked as Megatron marks expert weights (``allreduce = False``),
so their gradients are reduced over the expert-data-parallel group. Grouped-GEMM experts (``GroupedMLP``,
``TEGroupedMLP``) are refused by name; rlmega builds ``SequentialMLP`` (``moe_grouped_gemm=False``).

Adapters hook Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local spec) and the
transformer-engine spec's ``TEColumnParallelLinear`` / ``TERowParallelLinear``. ``TELayerNormColumnParallelLinear``
fuses the input norm into ``linear_qkv`` and ``linear_fc1``, so its input is the un-normalised hidden state: the
adapter asks the layer to also return its normalised input (transformer-engine's ``return_layernorm_output``, not
gathered: TE drops the gradient of a gathered one) and applies ``A`` to that. MTP layers are not adapted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from typing import Iterator, Optional

import torch

LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_MODULES = ("experts.linear_fc1", "experts.linear_fc2")
TARGET_MODULES = LINEAR_MODULES + EXPERT_MODULES

# The linear layers adapted, by class name (transformer-engine's classes are known by name: TE is GPU-only).
_COLUMN_PARALLEL = ("ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear")
_ROW_PARALLEL = ("RowParallelLinear", "TERowParallelLinear")
_NORM_FUSED = "TELayerNormColumnParallelLinear"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


@dataclasses.dataclass
class LoraConfig:
    rank: int = 0
    """Rank r of the adapters; 0: no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """The adapters' output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Probability of dropping each element of an adapter's input in training passes (PEFT's ``lora_dropout``);
    log-prob passes and the merged weights never drop."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LINEAR_MODULES))
    """Megatron's linear layers to adapt in every decoder layer: linear_qkv (q, k, v), linear_proj (o),
    linear_fc1 (gate and up), linear_fc2 (down) of attention and the dense MLP (and shared experts);
    experts.linear_fc1, experts.linear_fc2: every routed expert's."""

    def check(self, section: str) -> None:
        """Raise ValueError naming the first bad field under ``section`` (e.g. ``actor.lora``)."""
        if self.rank < 0:
            raise ValueError(f"{section}.rank must be >= 0 (0 turns LoRA off), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"{section}.alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{section}.dropout must be in [0, 1) (0: no dropout), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(TARGET_MODULES))
        if unknown or not self.target_modules:
            raise ValueError(f"{section}.target_modules must be a non-empty list of {', '.join(TARGET_MODULES)} "
                             f"(Megatron's names: q/k/v, o, gate/up, down; experts.*: the routed experts'); "
                             f"got {list(self.target_modules)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _GradientSummed(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class Adapter(torch.nn.Module):
    """The low-rank pair of one linear layer, held as its ``adapter`` child; ``lora_a [r, in]`` and ``lora_b [out, r]``
    are this TP (expert-TP for an expert) rank's shards (see the module docstring)."""

    def __init__(self, base: torch.nn.Module, config: LoraConfig, seed: int, *, expert: bool = False):
        super().__init__()
        weight = base.weight
        self.row_parallel = _is_row_parallel(base)
        self.scale = config.scale
        self.dropout = config.dropout
        self.enabled = True
        megatron_group = getattr(base, "_tp_group", None)  # where Megatron's wrappers of TE layers keep it
        self.tp_group = base.tp_group if megatron_group is None else megatron_group
        self.expert = expert
        expert_parallel = not getattr(weight, "allreduce", True)
        # Megatron's own test for an expert layer that leaves its communication to the token dispatcher.
        self.explicit_expert_comm = expert and (self.tp_group.size() > 1 or expert_parallel)
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.explicit_expert_comm
        if expert and self.dropout and not self.row_parallel and self.tp_group.size() > 1:
            raise ValueError("lora.dropout on experts.linear_fc1 needs etp=1: expert-TP ranks draw their dropout "
                             "from different seeds but must drop the same elements of the expert's input")
        out_features, in_features = weight.shape  # this rank's shard of the base weight
        kwargs = dict(dtype=weight.dtype, device=weight.device)
        self.lora_a = torch.nn.Parameter(torch.empty(config.rank, in_features, **kwargs))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, config.rank, **kwargs))
        self.reset_a(seed)
        split, whole = (self.lora_a, self.lora_b) if self.row_parallel else (self.lora_b, self.lora_a)
        # The attributes Megatron reads: how a parameter is TP-split, and over which data-parallel group it is
        # reduced (the expert-data-parallel one for experts' parameters, marked allreduce = False).
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, int(self.row_parallel), 1
        whole.tensor_model_parallel = False
        for param in (self.lora_a, self.lora_b):
            param.allreduce = not expert_parallel
            param.is_lora_adapter = True
        # A column-parallel A under sequence parallelism: each rank's gradient covers its B rows; Megatron sums the
        # gradients of parameters marked so over the TP ranks (as for the replicated norms).
        self.lora_a.sequence_parallel = self.sequence_parallel and not self.row_parallel

    @torch.no_grad()
    def reset_a(self, seed: int) -> None:
        """PEFT's initialisation of A (uniform in +-1/sqrt(in), Kaiming's with a = sqrt(5)), drawn whole from ``seed``
        and split like the base layer: the same adapter in every layout and on every replica."""
        rank, size = self.tp_group.rank(), self.tp_group.size()
        columns = self.lora_a.shape[1] * (size if self.row_parallel else 1)
        generator = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(columns)
        whole = torch.empty(self.lora_a.shape[0], columns).uniform_(-bound, bound, generator=generator)
        if self.row_parallel:
            whole = whole.chunk(size, dim=1)[rank]
        self.lora_a.copy_(whole)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)`` for the base layer's input ``x [s, b, in]`` (an expert's ``[tokens, in]``),
        laid out like the base layer's output."""
        from megatron.core.tensor_parallel import mappings

        x = self._dropped(x)
        if self.explicit_expert_comm:
            return self._expert_delta(x)
        if self.row_parallel:
            low = mappings.reduce_from_tensor_model_parallel_region(x @ self.lora_a.t(), group=self.tp_group)
            out = low @ self.lora_b.t()
            if self.sequence_parallel:
                out = mappings.scatter_to_sequence_parallel_region(out, group=self.tp_group)
            return out * self.scale
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
            low = x @ self.lora_a.t()
        else:
            low = mappings.copy_to_tensor_model_parallel_region(x @ self.lora_a.t(), group=self.tp_group)
        return (low @ self.lora_b.t()) * self.scale

    def _expert_delta(self, x: torch.Tensor) -> torch.Tensor:
        """An expert's share of ``scale * B A x`` on this expert-TP rank; the dispatcher sums the shares."""
        if self.row_parallel:
            return (x @ self.lora_a.t()) @ self._summed(self.lora_b).t() * self.scale
        return (x @ self._summed(self.lora_a).t()) @ self.lora_b.t() * self.scale

    def _summed(self, whole: torch.Tensor) -> torch.Tensor:
        return whole if self.tp_group.size() == 1 else _GradientSummed.apply(whole, self.tp_group)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with dropout in a training pass (gradients on), drawn from Megatron's random states so activation
        recomputation redraws the same elements: the default state where ``x`` is the same on every TP rank (as
        Megatron's hidden dropout), the tensor-parallel state where each rank holds its own part of it (as
        attention dropout), the expert-parallel state for experts."""
        if not (self.dropout and self.training and torch.is_grad_enabled()):
            return x
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        if self.expert:
            state = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
        elif self.row_parallel or self.sequence_parallel:
            state = get_cuda_rng_tracker().fork()
        else:
            state = contextlib.nullcontext()
        with state:
            return torch.nn.functional.dropout(x, self.dropout, training=True)

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight this rank computes with: ``weight`` itself when the adapter is off (so writes to it load the
        base), else a new tensor ``weight + scale * B @ A`` of this TP shard (both factors are local)."""
        if not self.enabled:
            return weight
        with torch.no_grad():
            delta = (self.lora_b.float() @ self.lora_a.float()) * self.scale
            return (weight.detach().float() + delta).to(weight.dtype)


def _class_names(module: torch.nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _is_row_parallel(module: torch.nn.Module) -> bool:
    names = _class_names(module)
    if names & set(_ROW_PARALLEL):
        return True
    if names & set(_COLUMN_PARALLEL):
        return False
    raise ValueError(f"LoRA adapts Megatron's {', '.join(_COLUMN_PARALLEL + _ROW_PARALLEL)}; this model's layer is "
                     f"a {type(module).__name__}, not supported")


def _add_delta(module, args, output):
    adapter = module.adapter
    if not adapter.enabled:
        return output
    result, bias = output
    return result + adapter.delta(args[0]).to(result.dtype), bias


def _norm_fused_forward(module: torch.nn.Module):
    """``forward`` of a ``TELayerNormColumnParallelLinear`` whose adapter reads the normalised input: the layer
    returns it too (``(out, bias, normed)`` with ``te_return_bias``, else Megatron's wrapper returns
    ``((out, normed), None)``), and the result is ``(out + delta(normed), bias)`` as before."""
    forward = module.forward
    module.return_layernorm_output = True
    module.return_layernorm_output_gathered = False

    def adapted_forward(x):
        output = forward(x)
        if module.te_return_bias:
            out, bias, normed = output
        else:
            (out, normed), bias = output
        if module.adapter.enabled:
            out = out + module.adapter.delta(normed).to(out.dtype)
        return out, bias

    return adapted_forward


def _sharded_state_dict(module, base_method, gated: bool):
    """The layer's ``sharded_state_dict`` with its adapter sharded as the adapter is: Megatron's linear layers
    describe every other tensor of theirs as whole on each TP rank. ``gated``: a SwiGLU ``linear_fc1``, whose B rows
    are [gate; up] per TP shard like its weight's, resharded as Megatron's MLP reshards that weight. An expert's
    offsets carry its global index and ``SequentialMLP`` sets the replica ids, as for its weights."""

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = base_method(prefix, sharded_offsets, metadata)
        adapter = module.adapter
        split = "lora_a" if adapter.row_parallel else "lora_b"
        own = make_sharded_tensors_for_checkpoint(
            adapter.state_dict(prefix="", keep_vars=True), f"{prefix}adapter.", {split: int(adapter.row_parallel)},
            sharded_offsets, tp_group=adapter.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group") or
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        if gated:
            key = f"{prefix}adapter.lora_b"
            own[key] = apply_swiglu_sharded_factory(own[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
        state.update(own)
        return state

    return sharded_state_dict


def _target_of(name: str) -> Optional[str]:
    """The ``target_modules`` name of the module ``name`` of a GPT model, if it is an adaptable linear layer."""
    if not name.startswith("decoder.layers."):  # MTP layers, embedding, output layer
        return None
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in LINEAR_MODULES:
        return None
    if ".mlp.experts." not in name:
        return leaf
    return f"experts.{leaf}" if ".mlp.experts.local_experts." in name else None


def _check_experts(model: torch.nn.Module, config: LoraConfig) -> None:
    if not set(config.target_modules) & set(EXPERT_MODULES):
        return
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts") and type(module).__name__ != "SequentialMLP":
            raise ValueError(f"LoRA on experts adapts Megatron's SequentialMLP (one linear pair per expert); this "
                             f"model's experts are a {type(module).__name__} (grouped GEMM): build it with "
                             f"moe_grouped_gemm off or drop {', '.join(EXPERT_MODULES)} from lora.target_modules")


def attach(model: torch.nn.Module, config: LoraConfig) -> int:
    """Add an adapter to each of ``config.target_modules`` in ``model``'s decoder layers (not MTP layers),
    freezing every other parameter. Returns the number of layers adapted."""
    model.requires_grad_(False)
    _check_experts(model, config)
    adapted = 0
    for name, module in list(model.named_modules()):
        target = _target_of(name)
        if target not in config.target_modules:
            continue
        module.adapter = Adapter(module, config, seed=_stable_seed(model, name), expert=target in EXPERT_MODULES)
        module.weight.lora_adapter = module.adapter
        object.__setattr__(module.adapter, "base_weight", module.weight)  # a reference, not a child parameter
        if _NORM_FUSED in _class_names(module):
            module.forward = _norm_fused_forward(module)
        else:
            module.register_forward_hook(_add_delta)
        gated = target.endswith("linear_fc1") and module.config.gated_linear_unit
        module.sharded_state_dict = _sharded_state_dict(module, module.sharded_state_dict, gated)
        adapted += 1
    if not adapted:
        raise ValueError(f"lora.target_modules {list(config.target_modules)} matched no layer of this model")
    return adapted


def global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (a module in a decoder layer of the GPT ``model``) with its layer index made Megatron's global
    ``layer_number`` (from 1) and an expert's local index its global one, so it names the same layer in every
    pipeline and expert-parallel layout."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if not match:
        return name
    layer, rest = model.decoder.layers[int(match.group(1))], match.group(2)
    expert = _EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(expert.group(1))]}.{expert.group(2)}"
    return f"decoder.layers.{layer.layer_number}.{rest}"


def _stable_seed(model: torch.nn.Module, name: str) -> int:
    """A seed from the layer's global name: the same adapter in every layout."""
    return zlib.crc32(global_name(model, name).encode())


def _gpt_model(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor."""
    return ".adapter.lora_" in key


def adapters(chunks: list) -> Iterator[tuple[str, Adapter]]:
    """``(global name of the adapted layer, its adapter)`` in ``chunks``, in module order."""
    for chunk in chunks:
        model = _gpt_model(chunk)
        for name, module in model.named_modules():
            if isinstance(module, Adapter):
                yield global_name(model, name.removesuffix(".adapter")), module


@torch.no_grad()
def fold(chunks: list) -> None:
    """Merge every adapter into its base weight (``W <- W + scale * B @ A``) and zero ``B``: the model computes the
    same, and the base model is now what the adapted one was."""
    for _, adapter in adapters(chunks):
        weight = adapter.base_weight
        weight.copy_(adapter.effective_weight(weight))
        adapter.lora_b.zero_()


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """The base model alone inside the block: the adapters add nothing, and merged reads give the base weights."""
    found = [adapter for _, adapter in adapters(chunks)]
    previous = [adapter.enabled for adapter in found]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, enabled in zip(found, previous):
            adapter.enabled = enabled

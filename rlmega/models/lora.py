"""Low-rank adapters (LoRA) on a Megatron model's linear layers, sharded with their base layer.

An adapted layer computes ``W x + scale * B (A x)`` with ``A [r, in]``, ``B [out, r]`` and ``scale = alpha / r``; the
base weight ``W`` is frozen, ``B`` starts at zero (the adapted model starts as the base model), ``A`` at small random
values. Tensor parallelism splits the adapter as it splits the base layer:

- column parallel (``linear_qkv``, ``linear_fc1``; output rows split): ``B`` is split on its rows like ``W``, ``A`` is
  whole on every TP rank. The rank-r activation ``A x`` is whole everywhere; its gradient is summed over the TP ranks
  (each holds the part from its own rows of ``B``) so that ``A``'s gradient is the same on every rank.
- row parallel (``linear_proj``, ``linear_fc2``; input columns split): ``A`` is split on its columns like ``W``,
  ``B`` is whole. ``A x`` is summed over the TP ranks (an all-reduce of ``r`` values per token), then ``B`` applies.

Under sequence parallelism a column-parallel adapter gathers the sequence as its base layer does, and ``A``'s
gradient, partial per rank, is summed by Megatron's own all-reduce of sequence-parallel parameters; a row-parallel
adapter keeps its rank's share of the sequence. The merged weight of a TP shard is ``W_shard + scale * B_s @ A_s``
with both factors local, so merging needs no communication (``effective_weight``).

Adapters hook Megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local spec). The
transformer-engine spec fuses the input norm into ``linear_qkv`` and ``linear_fc1``
(``TELayerNormColumnParallelLinear``), whose input is the un-normalised hidden state: an adapter there needs the
layer's normalised output (transformer-engine's ``return_layernorm_output``), not built yet, so ``attach`` refuses
those layers by name. Experts (``mlp.experts``) and MTP layers are not adapted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from typing import Iterator

import torch

LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclasses.dataclass
class LoraConfig:
    rank: int = 0
    """Rank r of the adapters; 0: no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """The adapters' output is scaled by ``alpha / rank``."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LINEAR_MODULES))
    """Megatron's linear layers to adapt in every decoder layer: linear_qkv (q, k, v), linear_proj (o),
    linear_fc1 (gate and up), linear_fc2 (down). Experts are not adapted."""

    def check(self, section: str) -> None:
        """Raise ValueError naming the first bad field under ``section`` (e.g. ``actor.lora``)."""
        if self.rank < 0:
            raise ValueError(f"{section}.rank must be >= 0 (0 turns LoRA off), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"{section}.alpha must be positive, got {self.alpha}")
        unknown = sorted(set(self.target_modules) - set(LINEAR_MODULES))
        if unknown or not self.target_modules:
            raise ValueError(f"{section}.target_modules must be a non-empty list of {', '.join(LINEAR_MODULES)} "
                             f"(Megatron's names: q/k/v, o, gate/up, down); got {list(self.target_modules)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Adapter(torch.nn.Module):
    """The low-rank pair of one linear layer, held as its ``adapter`` child; ``lora_a [r, in]`` and ``lora_b [out, r]``
    are this TP rank's shards (see the module docstring)."""

    def __init__(self, base: torch.nn.Module, config: LoraConfig, seed: int):
        super().__init__()
        weight = base.weight
        self.row_parallel = _is_row_parallel(base)
        self.scale = config.scale
        self.enabled = True
        self.tp_group = base.tp_group
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        out_features, in_features = weight.shape  # this rank's shard of the base weight
        kwargs = dict(dtype=weight.dtype, device=weight.device)
        self.lora_a = torch.nn.Parameter(torch.empty(config.rank, in_features, **kwargs))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_features, config.rank, **kwargs))
        self.reset_a(seed)
        split, whole = (self.lora_a, self.lora_b) if self.row_parallel else (self.lora_b, self.lora_a)
        # The attributes Megatron reads: how a parameter is TP-split, and that it is reduced over data parallelism.
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, int(self.row_parallel), 1
        whole.tensor_model_parallel = False
        for param in (self.lora_a, self.lora_b):
            param.allreduce = True
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
        """``scale * B A x`` for the base layer's input ``x [s, b, in]``, laid out like the base layer's output."""
        from megatron.core.tensor_parallel import mappings

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

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight this rank computes with: ``weight`` itself when the adapter is off (so writes to it load the
        base), else a new tensor ``weight + scale * B @ A`` of this TP shard (both factors are local)."""
        if not self.enabled:
            return weight
        with torch.no_grad():
            delta = (self.lora_b.float() @ self.lora_a.float()) * self.scale
            return (weight.detach().float() + delta).to(weight.dtype)


def _is_row_parallel(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, RowParallelLinear):
        return True
    if isinstance(module, ColumnParallelLinear):
        return False
    raise ValueError(f"LoRA adapts Megatron's ColumnParallelLinear and RowParallelLinear (the local layer spec); "
                     f"this model's layer is a {type(module).__name__} (transformer-engine spec), not supported yet")


def _add_delta(module, args, output):
    adapter = module.adapter
    if not adapter.enabled:
        return output
    result, bias = output
    return result + adapter.delta(args[0]).to(result.dtype), bias


def _sharded_state_dict(module, base_method, gated: bool):
    """The layer's ``sharded_state_dict`` with its adapter sharded as the adapter is: Megatron's linear layers
    describe every other tensor of theirs as whole on each TP rank. ``gated``: a SwiGLU ``linear_fc1``, whose B rows
    are [gate; up] per TP shard like its weight's, resharded as Megatron's MLP reshards that weight."""

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


def attach(model: torch.nn.Module, config: LoraConfig) -> int:
    """Add an adapter to each of ``config.target_modules`` in ``model``'s decoder layers (not experts, not MTP layers),
    freezing every other parameter. Returns the number of layers adapted."""
    model.requires_grad_(False)
    adapted = 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in config.target_modules or not name.startswith("decoder.layers.") or ".experts." in name:
            continue
        module.adapter = Adapter(module, config, seed=_stable_seed(model, name))
        module.weight.lora_adapter = module.adapter
        object.__setattr__(module.adapter, "base_weight", module.weight)  # a reference, not a child parameter
        module.register_forward_hook(_add_delta)
        gated = leaf == "linear_fc1" and module.config.gated_linear_unit
        module.sharded_state_dict = _sharded_state_dict(module, module.sharded_state_dict, gated)
        adapted += 1
    if not adapted:
        raise ValueError(f"lora.target_modules {list(config.target_modules)} matched no layer of this model")
    return adapted


def global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (a module in a decoder layer of the GPT ``model``) with its layer index made Megatron's global
    ``layer_number`` (from 1), so it names the same layer in every pipeline layout."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if not match:
        return name
    return f"decoder.layers.{model.decoder.layers[int(match.group(1))].layer_number}.{match.group(2)}"


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

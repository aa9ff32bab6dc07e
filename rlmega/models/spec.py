"""A model as Megatron-Core needs it: ``TransformerConfig`` fields, GPTModel arguments, layer spec.

``ModelSpec`` is what an architecture adapter (``rlmega.models.architectures``) derives from a
Hugging Face ``config.json``; ``build_chunks`` turns it into this rank's Megatron model chunks for
a parallel layout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any, Optional

import torch

from rlmega.models import mla_query
from rlmega.models.mtp_model import gpt_model_with_mtp
from rlmega.models.reward_head import ScoreHeadSpec, attach_score_head
from rlmega.models.vision_language import VisionSpec, vision_language_model_class
from rlmega.parallel.layout import ParallelLayout

VOCAB_DIVISIBLE_BY = 128
# Padding the vocabulary to a multiple that every TP size up to 8 divides makes the embedding and
# output layer the same shape at all those sizes, so a checkpoint saved at one TP loads at another.
VOCAB_PAD_MULTIPLE = 1024


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron splits the vocabulary evenly over TP ranks, in slices of a multiple of ``divisible_by``.

    Rounds up to ``VOCAB_PAD_MULTIPLE`` (the same for every tp <= 8) or to ``divisible_by * tp``
    for larger tp, whichever is the larger multiple.
    """
    multiple = math.lcm(divisible_by * tp, VOCAB_PAD_MULTIPLE)
    return math.ceil(vocab_size / multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build the Megatron twin of a Hugging Face causal LM (or of a sequence
    classifier: the same trunk with a score head)."""

    architecture: str
    """The HF ``architectures`` entry this spec came from."""
    config: dict[str, Any]
    """``TransformerConfig`` fields that describe the model (not the parallel layout or dtype)."""
    vocab_size: int
    """The HF vocabulary size, before padding for tensor parallelism."""
    max_sequence_length: int
    rotary_base: float
    tie_word_embeddings: bool
    rope_scaling_factor: Optional[float] = None
    """Llama-3 style RoPE scaling factor, or None for plain RoPE."""
    score_head: Optional[ScoreHeadSpec] = None
    """A ``*ForSequenceClassification`` checkpoint's score head, which replaces the LM head
    (``rlmega.models.reward_head``); None for a causal LM."""
    notes: tuple[str, ...] = ()
    """One-line remarks on how the checkpoint was read (e.g. MTP layers config.json announces but the
    weights lack), for the command line to show once."""
    vision: Optional[VisionSpec] = None
    """A vision-language model's vision side (``rlmega.models.vision_language``); None for text only."""
    unused_hf_prefixes: tuple[str, ...] = ()
    """HF tensor names starting with these are in the checkpoint but not built (MTP layers turned off);
    the importer leaves them unread."""

    @property
    def num_layers(self) -> int:
        return self.config["num_layers"]

    @property
    def num_experts(self) -> Optional[int]:
        return self.config.get("num_moe_experts")

    @property
    def mtp_num_layers(self) -> int:
        """Multi-token prediction layers (DeepSeek-V3), all on the last pipeline stage."""
        return self.config.get("mtp_num_layers") or 0

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise LayoutError unless this model can be split as ``layout`` says."""
        layout.check_model(
            num_layers=self.num_layers,
            num_attention_heads=self.config["num_attention_heads"],
            num_query_groups=self.config.get("num_query_groups"),
            num_experts=self.num_experts,
            ffn_hidden_size=self.config.get("ffn_hidden_size"),
            expert_ffn_hidden_size=self.config.get("moe_ffn_hidden_size"),
        )

    def transformer_config(self, layout: ParallelLayout, *, params_dtype: torch.dtype = torch.float32, **overrides):
        """The Megatron ``TransformerConfig`` for this model in ``layout``."""
        from megatron.core.transformer import TransformerConfig

        self.check_layout(layout)
        fields = dict(
            self.config,
            **layout.megatron_sizes(),
            num_layers_in_first_pipeline_stage=layout.first_stage_layers,
            num_layers_in_last_pipeline_stage=layout.last_stage_layers,
            use_cpu_initialization=not torch.cuda.is_available(),
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
        )
        fields.update(overrides)
        if self.config.get("multi_latent_attention"):
            from megatron.core.transformer import MLATransformerConfig

            fields.pop("multi_latent_attention")
            return MLATransformerConfig(**fields)
        return TransformerConfig(**fields)

    def layer_spec(self, *, dense: bool = False):
        """Transformer-engine layers where TE is installed, Megatron's local (torch) layers otherwise,
        attending with ``TorchCoreAttention``.

        ``dense``: the spec of this model's dense layers when it mixes dense and MoE layers.
        """
        from megatron.core.models.gpt import gpt_layer_specs

        latent = bool(self.config.get("multi_latent_attention"))
        kwargs = dict(
            num_experts=None if dense else self.num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=self.config.get("qk_layernorm", False),
            multi_latent_attention=latent,
        )
        if has_transformer_engine():
            return self._query_as_hf(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs))
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=self.config["normalization"], **kwargs)
        # Megatron's local DotProductAttention rejects MLA's head sizes and context parallelism, and
        # materialises every [S, S] score matrix; ours runs torch's fused attention (benchmarks/context_parallel.py).
        from rlmega.models.core_attention import TorchCoreAttention

        spec.submodules.self_attention.submodules.core_attention = TorchCoreAttention
        return self._query_as_hf(spec)

    def _query_as_hf(self, spec):
        """``spec`` with its attention computing the query as HF does (``rlmega.models.mla_query``)."""
        if self.config.get("multi_latent_attention") and self.config.get("q_lora_rank") is None:
            spec.submodules.self_attention.module = mla_query.attention_without_query_norm()
        return spec

    def decoder_spec(self, config, vp_stage: Optional[int] = None):
        """The decoder spec of one model chunk: ``layer_spec()``, or, where dense and MoE layers mix
        (``moe_layer_freq`` is a list of 0/1 per layer), the per-layer specs of this chunk's layers."""
        pattern = self.config.get("moe_layer_freq")
        if not isinstance(pattern, list):
            return self.layer_spec()
        from megatron.core.transformer.transformer_block import (
            LayerNormImpl,
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        dense, moe = self.layer_spec(dense=True), self.layer_spec()
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        count = get_num_layers_to_build(config, vp_stage=vp_stage)
        # The same final norm Megatron picks for a plain layer spec.
        return TransformerBlockSubmodules(
            layer_specs=[moe if is_moe else dense for is_moe in pattern[first : first + count]],
            layer_norm=LayerNormImpl,
        )

    def mtp_block_spec(self, config, vp_stage: Optional[int] = None):
        """The MTP block spec of one model chunk: None unless the model has MTP layers and the chunk
        is the last pipeline stage. Each MTP layer's transformer layer is built like the last decoder
        layer (MoE where the model has experts)."""
        if not self.mtp_num_layers:
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        return get_gpt_mtp_block_spec(config, self.layer_spec(), has_transformer_engine(), vp_stage=vp_stage)


def build_chunks(spec: ModelSpec, layout: ParallelLayout, config=None) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage), not yet wrapped in DDP.

    Megatron's process groups for ``layout`` must exist (``rlmega.parallel.layout.initialize``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = config or spec.transformer_config(layout)
    model_class = gpt_model_with_mtp() if spec.mtp_num_layers else GPTModel
    extra = {"position_embedding_type": "rope"}
    if spec.vision is not None:
        model_class, extra = vision_language_model_class(), {"vision": spec.vision}
    virtual = layout.virtual_stages > 1
    chunks = []
    for vp_stage in range(layout.virtual_stages):
        stage = vp_stage if virtual else None
        model = model_class(
            config,
            spec.decoder_spec(config, vp_stage=stage),
            vocab_size=padded_vocab_size(spec.vocab_size, layout.tp),
            max_sequence_length=spec.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            vp_stage=stage,
            mtp_block_spec=spec.mtp_block_spec(config, vp_stage=stage),
            **extra,
        )
        if spec.score_head is not None:
            attach_score_head(model, spec.score_head, config)
        chunks.append(on_training_device(model, config))
    return chunks


def sharded_model_state(chunks: list) -> dict:
    """The model part of a Megatron training checkpoint: ``model``, or ``model0``, ``model1``... per virtual
    stage, each chunk's ``sharded_state_dict`` (chunks without their DDP wrapper)."""
    from megatron.core import parallel_state

    # GPTModel.sharded_state_dict reads metadata["dp_cp_group"] itself on a stage with MTP but no embedding (pp > 1),
    # to tie that stage's copy of the embedding. megatron-core 0.16's guard fills the group in only for the callees (a
    # None becomes a new dict there), so without metadata that read fails on None. Megatron-LM's checkpoints pass the
    # key; the group is the guard's own default, so every other model's checkpoint is unchanged.
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{index}": chunk.sharded_state_dict(metadata=metadata) for index, chunk in enumerate(chunks)}


def on_training_device(model: torch.nn.Module, config) -> torch.nn.Module:
    """``model`` whole on the current GPU unless ``config`` initialises on the CPU. Megatron allocates its
    parallel layers on the GPU but builds the modules it takes from torch (the norms, where neither
    transformer-engine nor apex is installed) on the CPU, and leaves moving the model to its caller."""
    if config.use_cpu_initialization:
        return model
    return model.cuda(torch.cuda.current_device())

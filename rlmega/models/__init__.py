"""Hugging Face architectures as Megatron-Core models: config, layer spec, model chunks."""

from rlmega.models.architectures import ARCHITECTURES, UnsupportedModelError, model_spec_from_hf, read_hf_config
from rlmega.models.spec import ModelSpec, build_chunks, has_transformer_engine, padded_vocab_size, sharded_model_state

__all__ = [
    "ARCHITECTURES",
    "ModelSpec",
    "UnsupportedModelError",
    "build_chunks",
    "has_transformer_engine",
    "model_spec_from_hf",
    "padded_vocab_size",
    "read_hf_config",
    "sharded_model_state",
]

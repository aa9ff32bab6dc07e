"""Hugging Face <-> Megatron-Core weights, exact in every parallel layout.

``load_hf_weights`` fills a sharded Megatron model from HF safetensors (each rank reads its own
slices); ``export_hf_weights`` streams the HF tensors back out in bounded buckets. The same stream
feeds weight sync to rollout engines and the checkpoint converters.
"""

from rlmega.bridge.export import DEFAULT_BUCKET_BYTES, export_hf_weights
from rlmega.bridge.hf_checkpoint import CheckpointError, HFCheckpoint
from rlmega.bridge.load import load_hf_weights

__all__ = ["DEFAULT_BUCKET_BYTES", "CheckpointError", "HFCheckpoint", "export_hf_weights", "load_hf_weights"]

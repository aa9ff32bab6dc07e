"""Checkpoint conversion: Megatron torch_dist <-> Hugging Face safetensors, thin over ``rlmega.bridge``.

- ``mcore_to_hf.convert``: a torch_dist checkpoint (any layout) -> an HF directory, reading tensors
  directly with ``torch.distributed.checkpoint``: no model build, no process group.
- ``hf_to_mcore.convert``: an HF directory -> a torch_dist checkpoint for a target layout.
- ``verify.verify``: an exported HF directory against a reference, bit for bit or by logits.

The command line is ``rlmega convert ...`` or ``python -m converters ...`` (``converters.cli``).
"""

from converters.errors import ConversionError

__all__ = ["ConversionError"]

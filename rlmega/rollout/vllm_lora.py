"""A vLLM engine serving a LoRA actor's adapters over base weights it loaded once (``sync.lora=adapters``).

Each weight update carries the adapter as a PEFT adapter in tensors: ``base_model.model.<HF module>.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (rlmega.workers.lora_export), and its ``adapter_config.json`` as one
uint8 tensor of that name (``config_tensor``), so every bucket transport carries it unchanged. Base weights in the same
stream (the base a warm-start folded the adapters into) load as in any update. At the commit the adapter is written
as a PEFT directory (under a temporary name, then renamed) and loaded by vLLM from there; the one before is removed.

vLLM's side (vllm 0.33.0 and 0.34.0 wheels): vllm/lora/request.py (``LoRARequest(lora_name, lora_int_id, lora_path)``,
``lora_int_id`` > 0), vllm/v1/engine/llm_engine.py (``add_lora`` / ``remove_lora`` / ``list_loras``),
vllm/entrypoints/llm.py (``generate(..., lora_request=...)``), vllm/config/lora.py (``max_lora_rank`` one of
``MaxLoRARanks``), vllm/lora/peft_helper.py (``PEFTHelper.from_local_dir`` reads adapter_config.json: ``r``,
``lora_alpha``, scale ``lora_alpha / r``; ``validate_legal`` refuses a rank above ``max_lora_rank``),
vllm/lora/lora_model.py (``from_local_checkpoint`` reads adapter_model.safetensors and refuses a module outside the
model's LoRA modules, which for Llama / Qwen2 (vllm/model_executor/models/llama.py, qwen2.py:
``packed_modules_mapping``) are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: PEFT's names, packed
by vLLM into qkv_proj and gate_up_proj).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_name(name: str) -> bool:
    """Whether a streamed name belongs to the adapter (its tensors or its config), not to the base model."""
    return name == ADAPTER_CONFIG or name.startswith(PEFT_PREFIX)


def config_tensor(config: dict) -> torch.Tensor:
    """``adapter_config.json`` as a uint8 tensor, so that it travels in a stream of named tensors."""
    return torch.frombuffer(bytearray(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)


def config_of(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())


def max_lora_rank(rank: int, allowed: Sequence[int]) -> int:
    """The smallest of vLLM's ``allowed`` ranks (vllm/config/lora.py ``MaxLoRARanks``) that holds ``rank``."""
    fitting = [size for size in sorted(allowed) if size >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"a LoRA rank of {rank} cannot be served by vLLM, whose max_lora_rank is one of "
                         f"{sorted(allowed)}: choose actor.lora.rank between 1 and {max(allowed)}")
    return fitting[0]


class AdapterFiles:
    """The adapter an update brings (``take``), and the PEFT directories vLLM loads, each written once, under
    ``root`` (default: a directory of its own in /dev/shm where it exists, removed with this object)."""

    def __init__(self, root: Optional[str] = None):
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._owned = None if root else tempfile.TemporaryDirectory(prefix="rlmega-lora-", dir=shm)
        self.root = Path(root or self._owned.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_config: Optional[dict] = None

    def take(self, named_tensors):
        """The base weights of a stream, passed on; the adapter's tensors kept for the commit (copied: a transport
        may reuse its buffers)."""
        for name, tensor in named_tensors:
            if name == ADAPTER_CONFIG:
                self.pending_config = config_of(tensor)
            elif name.startswith(PEFT_PREFIX):
                self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
            else:
                yield name, tensor

    def drop_pending(self) -> None:
        self.pending, self.pending_config = {}, None

    def has_pending(self) -> bool:
        return bool(self.pending) or self.pending_config is not None

    def write(self, name: str) -> Path:
        """The pending adapter as PEFT directory ``root/name``, written under a temporary name and renamed."""
        from safetensors.torch import save_file

        tensors, config = self.pending, self.pending_config
        self.drop_pending()
        if config is None or not tensors:
            raise ValueError(f"the update's adapter is incomplete: it carried {len(tensors)} adapter tensors and "
                             f"{'an' if config else 'no'} {ADAPTER_CONFIG}; a sync with sync.lora=adapters sends both")
        final, partial = self.root / name, self.root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        save_file(tensors, str(partial / ADAPTER_WEIGHTS))
        (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.replace(partial, final)
        return final

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

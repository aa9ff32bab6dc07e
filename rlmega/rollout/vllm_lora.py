"""vLLM's side of serving a LoRA actor's adapters (``sync.lora=adapters``; the engine-neutral part, the PEFT
directory and which adapter is served, is ``rlmega.rollout.lora_serving``).

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

from typing import Sequence


def max_lora_rank(rank: int, allowed: Sequence[int]) -> int:
    """The smallest of vLLM's ``allowed`` ranks (vllm/config/lora.py ``MaxLoRARanks``) that holds ``rank``."""
    fitting = [size for size in sorted(allowed) if size >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"a LoRA rank of {rank} cannot be served by vLLM, whose max_lora_rank is one of "
                         f"{sorted(allowed)}: choose actor.lora.rank between 1 and {max(allowed)}")
    return fitting[0]

"""vLLM's LoRA as the fake ``LLM`` emulates it (vllm 0.33.0; ``api/vllm.json`` holds the recorded fields and
signatures): ``LoRARequest`` (vllm/lora/request.py, its fields checked against the wheel's, the module it lives in
given as ``request_module``), ``LLM.llm_engine``'s ``add_lora`` / ``remove_lora`` / ``list_loras``
(vllm/v1/engine/llm_engine.py), and the adapter applied to every request that names it: the PEFT directory read as
vLLM reads it (vllm/lora/peft_helper.py: ``r``, ``lora_alpha``, scale ``alpha / r``, a rank above
``max_lora_rank`` refused; vllm/lora/lora_model.py: adapter_model.safetensors, a module the model takes no adapter
for refused) and the model computing with ``W + scale * B @ A`` for the request (``lora_math``)."""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import api_snapshot, lora_math

API = api_snapshot.load("vllm")
checked = functools.partial(api_snapshot.checked, API)
# vllm/model_executor/models/llama.py and qwen2.py: the LoRA modules (qkv_proj, o_proj, gate_up_proj, down_proj)
# with the packed ones under their checkpoint names (vllm/lora/worker_manager.py _load_adapter).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRARequest:  # vllm/lora/request.py
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


api_snapshot.check_fields(API, "LoRARequest", LoRARequest.__dataclass_fields__, complete=True)
request_module = types.ModuleType("vllm.lora.request")
request_module.LoRARequest = LoRARequest


class FakeLoRA:
    """The engine's adapters (``engine_args``: ``enable_lora``, ``max_lora_rank``, ``max_loras``) over ``model``."""

    def __init__(self, model, engine_args: dict):
        self.model = model
        self.enabled = bool(engine_args.get("enable_lora"))
        self.max_rank = engine_args.get("max_lora_rank", 16)
        if self.enabled and self.max_rank not in API["constants"]["MaxLoRARanks"]:  # vllm/config/lora.py (pydantic)
            raise ValueError(f"max_lora_rank: Input should be one of {API['constants']['MaxLoRARanks']}, "
                             f"got {self.max_rank}")
        self.max_loras = engine_args.get("max_loras", 1)
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}  # id -> HF weight name -> scale * B @ A
        self.loads: list[str] = []  # the paths read, in order
        self.caches: dict[int, dict] = {}  # vLLM's block hashes include the adapter id: a prefix cache per adapter
        self.requests: list[Optional[LoRARequest]] = []  # the lora_request of every generate call

    def _require_enabled(self) -> None:
        if not self.enabled:  # vllm/v1/worker/lora_model_runner_mixin.py
            raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")

    def add(self, request: LoRARequest) -> bool:
        self._require_enabled()
        if request.lora_int_id in self.adapters:  # vllm/lora/worker_manager.py add_adapter
            return False
        self.adapters[request.lora_int_id] = self._read(Path(request.lora_path))
        self.loads.append(request.lora_path)
        return True

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        config = lora_math.read_config(path)
        missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
        if missing:  # vllm/lora/peft_helper.py from_dict
            raise ValueError(f"Missing required configuration fields: {missing}")
        if config["r"] > self.max_rank:  # vllm/lora/peft_helper.py validate_legal
            raise ValueError(f"LoRA rank {config['r']} is greater than max_lora_rank {self.max_rank}.")
        if config.get("bias", "none") != "none":
            raise ValueError("Adapter bias is not supported.")
        tensors = lora_math.read_tensors(path)
        unexpected = sorted(name for name in tensors if lora_math.module_of(name) not in LORA_MODULES)
        if unexpected:  # vllm/lora/lora_model.py from_local_checkpoint
            raise ValueError(f"While loading {path}, expected target modules in {set(LORA_MODULES)} but received "
                             f"{unexpected}. Please verify that the loaded LoRA module is correct")
        return lora_math.deltas(config, tensors)

    @checked("LLMEngine.remove_lora")
    def remove_lora(self, lora_id: int) -> bool:
        self.caches.pop(lora_id, None)
        return self.adapters.pop(lora_id, None) is not None

    @checked("LLMEngine.add_lora")
    def add_lora(self, lora_request) -> bool:
        return self.add(lora_request)

    @checked("LLMEngine.list_loras")
    def list_loras(self) -> set[int]:
        return set(self.adapters)

    @contextlib.contextmanager
    def applied(self, request: Optional[LoRARequest]):
        """The model with ``request``'s adapter added to its weights (loaded on first use, as vLLM does)."""
        self.requests.append(request)
        if request is None:
            yield
            return
        self._require_enabled()
        if request.lora_int_id not in self.adapters:
            self.add(request)
        with lora_math.applied(self.model, self.adapters[request.lora_int_id],
                               self.caches.setdefault(request.lora_int_id, {})):
            yield

"""SGLang's LoRA as the fake ``Engine`` emulates it (sglang 0.5.23; ``api/sglang.json`` holds the recorded signatures,
fields and ``SUPPORTED_LORA_TARGET_MODULES``): the server arguments (sglang/srt/arg_groups/fields/lora.py, checked by
sglang/srt/arg_groups/lora_hook.py: without ``lora_paths``, ``max_lora_rank`` and ``lora_target_modules`` are
required), ``Engine.load_lora_adapter`` / ``unload_lora_adapter`` returning a ``LoRAUpdateOutput`` (io_struct.py) with
the refusals of sglang/srt/managers/tokenizer_control_mixin.py, sglang/srt/lora/lora_manager.py
(``validate_new_adapter``) and sglang/srt/lora/mem_pool.py (``can_support``: rank and normalized target modules), the
adapter a request names by ``lora_path`` (its name: sglang/srt/managers/tokenizer_manager.py ``_resolve_lora_path``),
and the model computing with ``W + scale * B @ A`` for that request (``lora_math``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import api_snapshot, lora_math

API = api_snapshot.load("sglang")
# sglang/srt/lora/utils.py get_normalized_target_modules: PEFT's names as SGLang's pool holds them.
NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}


@dataclasses.dataclass(kw_only=True)
class LoRAUpdateOutput:  # sglang/srt/managers/io_struct.py
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[dict] = None


api_snapshot.check_fields(API, "LoRAUpdateOutput", LoRAUpdateOutput.__dataclass_fields__, complete=True)


def _normalized(modules) -> set[str]:
    return {NORMALIZED.get(name, name) for name in modules}


class FakeSGLangLoRA:
    """The engine's adapters (server arguments ``enable_lora``, ``max_lora_rank``, ``lora_target_modules``) over
    ``model``."""

    def __init__(self, model, server_args: dict):
        self.model = model
        self.enabled = bool(server_args.get("enable_lora"))
        self.max_rank = server_args.get("max_lora_rank")
        targets = server_args.get("lora_target_modules") or []
        if self.enabled and not (server_args.get("lora_paths") or (self.max_rank and targets)):
            raise AssertionError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                                 "and --lora-target-modules for LoRA initialization.")
        unknown = sorted(set(targets) - set(API["constants"]["SUPPORTED_LORA_TARGET_MODULES"]))
        if unknown:  # the argument's choices
            raise ValueError(f"lora_target_modules: invalid choice(s) {unknown}")
        self.targets = _normalized(targets)
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # name -> HF weight name -> scale * B @ A
        self.loads: list[str] = []  # the paths read, in order
        self.caches: dict[str, dict] = {}  # the radix cache keys requests by adapter: a prefix cache per adapter
        self.requests: list[Optional[str]] = []  # the adapter of every request decoded (None: the base model)

    def load(self, name: str, path: str) -> LoRAUpdateOutput:
        if not self.enabled:
            return LoRAUpdateOutput(success=False, error_message="LoRA is not enabled. Please set `--enable-lora` "
                                                                 "to enable LoRA.")
        if name in self.adapters:
            return self._failed(f"Failed to load LoRA adapter {name} because it is already loaded")
        config = lora_math.read_config(path)
        if config["peft_type"].lower() != "lora":  # sglang/srt/lora/lora.py asserts
            return self._failed(f"peft_type {config['peft_type']} is not lora")
        if config["r"] > self.max_rank or not _normalized(config["target_modules"]) <= self.targets:
            return self._failed(
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                "and that the target modules are included in `--lora-target-modules`.")
        self.adapters[name] = lora_math.deltas(config, lora_math.read_tensors(path))
        self.loads.append(path)
        return self._result(success=True)

    def unload(self, name: str) -> LoRAUpdateOutput:
        if not self.enabled:
            return LoRAUpdateOutput(success=False, error_message="LoRA is not enabled. Please set `--enable-lora` "
                                                                 "to enable LoRA.")
        if name not in self.adapters:  # sglang/srt/lora/lora_registry.py unregister
            return LoRAUpdateOutput(success=False, error_message=f"LoRA with name {name} does not exist. Loaded "
                                                                 f"LoRAs: {self.adapters.keys()}")
        del self.adapters[name]
        self.caches.pop(name, None)
        return self._result(success=True)

    def _failed(self, message: str) -> LoRAUpdateOutput:
        return self._result(success=False, error_message=message)

    def _result(self, **fields) -> LoRAUpdateOutput:
        return LoRAUpdateOutput(**fields, loaded_adapters={name: name for name in self.adapters})

    def per_request(self, lora_path, count: int) -> list[Optional[str]]:
        """``lora_path`` as GenerateReqInput._normalize_lora_paths makes it, checked as the tokenizer manager does."""
        if lora_path is None:
            return [None] * count
        names = [lora_path] * count if isinstance(lora_path, str) else list(lora_path)
        if len(names) != count:
            raise ValueError(f"lora_path list length ({len(names)}) must match batch size ({count})")
        named = [name for name in names if name]
        if named and not self.enabled:
            raise ValueError(f"LoRA adapter '{named[0]}' was requested, but LoRA is not enabled. Please launch the "
                             "server with --enable-lora flag and preload adapters using --lora-paths or "
                             "/load_lora_adapter endpoint.")
        unknown = [name for name in named if name not in self.adapters]
        if unknown:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {unknown[0]}\n"
                             f"All loaded adapters: {self.adapters.keys()}.")
        return names

    def applied(self, name: Optional[str]):
        """The model with adapter ``name`` added to its weights for one request."""
        self.requests.append(name)
        if name is None:
            return lora_math.applied(self.model, {}, self.model.prefix_cache)
        return lora_math.applied(self.model, self.adapters[name], self.caches.setdefault(name, {}))

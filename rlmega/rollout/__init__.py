"""Rollout engines: the protocol the trainer talks to, a transformers-based engine, and adapters for
vLLM and SGLang.

Nothing here imports Megatron or the rest of rlmega's training stack. ``VLLMEngine`` and
``SGLangEngine`` are loaded on first use, so importing this package imports neither engine; ``HFEngine`` too, so that
a driver which only talks to engine actors does not import transformers' models. See README.md.
"""

import importlib

from rlmega.rollout.hf_weights import HFWeightMap, WeightTarget
from rlmega.rollout.protocol import (
    EngineNotReadyError,
    FinishReason,
    Generation,
    RolloutEngine,
    SamplingParams,
    UnknownWeightError,
)

__all__ = [
    "EngineNotReadyError",
    "FinishReason",
    "Generation",
    "HFEngine",
    "HFWeightMap",
    "RolloutEngine",
    "SGLangEngine",
    "SamplingParams",
    "UnknownWeightError",
    "VLLMEngine",
    "WeightTarget",
]

_LAZY = {"HFEngine": "rlmega.rollout.hf_engine", "VLLMEngine": "rlmega.rollout.vllm_engine", "SGLangEngine": "rlmega.rollout.sglang_engine"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

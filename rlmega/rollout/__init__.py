"""Rollout engines: the protocol the trainer talks to, and a transformers-based engine.

Nothing here imports Megatron or the rest of rlmega's training stack. See README.md.
"""

from rlmega.rollout.hf_engine import HFEngine
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
    "SamplingParams",
    "UnknownWeightError",
    "WeightTarget",
]

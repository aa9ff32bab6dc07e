"""The contract between the RL trainer and a rollout (generation) engine.

Engines know nothing of Megatron: they take token ids, return token ids and log-probs, and accept
weights under their Hugging Face on-disk names. See ``rlmega/rollout/README.md``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol, runtime_checkable

import torch

# "stop": ended with a stop token (kept); "length": reached max_new_tokens; "abort": interrupted by
# ``pause_generation()`` and holding the tokens generated so far (possibly none).
FinishReason = Literal["stop", "length", "abort"]


class EngineNotReadyError(RuntimeError):
    """``generate`` was called while the engine cannot produce samples from a known weight version
    (asleep, weights dropped by ``sleep(level=2)`` and not re-synced, or a torn weight update)."""


class UnknownWeightError(ValueError):
    """``update_weights`` received a name that is not a weight of the engine's model."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True as a count is a bug


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"SamplingParams.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the responses of one prompt.

    ``temperature == 0`` is greedy (argmax of the raw logits); ``top_k=None`` and ``top_p=1.0``
    disable those filters. Filters apply in the order temperature, top-k, top-p (top-p on the
    renormalised top-k distribution). A response ends at the first token in ``stop_token_ids``
    (that token is kept in the response) or after ``max_new_tokens`` tokens. ``n`` responses are
    drawn per prompt. A fixed ``seed`` makes the samples reproducible for the same prompts and
    weights; ``None`` draws fresh randomness.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("n", self.n, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        stop_token_ids = self.stop_token_ids
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids, got {stop_token_ids!r}")
        stop_token_ids = tuple(stop_token_ids)
        if not all(_is_int(token) and token >= 0 for token in stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must hold ints >= 0, got {stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)  # frozen: normalise a list to a tuple


@dataclass
class Generation:
    """One sampled response.

    ``logprobs[t]`` is ``log_softmax(logits / temperature)[response_token_ids[t]]`` at the step that
    sampled token t (the raw logits for greedy requests): the log-prob under the temperature-scaled
    distribution that was sampled from, before any top-k / top-p truncation. That is what the trainer
    recomputes from the same weights at the batch's temperature, so the two are directly comparable
    (``rollout_logp`` vs ``old_logp``).
    """

    prompt_index: int  # index into the ``prompts`` list given to ``generate``
    response_token_ids: list[int]
    logprobs: list[float]  # one per response token
    finish_reason: FinishReason  # "stop" (stop token kept), "length" (max_new_tokens) or "abort" (paused)
    weight_version: int  # the engine's weight version when this response was generated
    routing: Optional[torch.Tensor] = None
    """MoE engines asked to record routing: ``[P + R, M, k]`` int16, the experts every prompt and
    response token went to in each of the M MoE layers (``rlmega.workers.routing``, R3)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine (HF, vLLM, SGLang, ...)."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Generation]:
        """Sample ``params.n`` responses per prompt.

        ``params`` is one ``SamplingParams`` for all prompts or one per prompt. The result is
        prompt-major: all responses of prompt 0 (in sample order), then prompt 1, and so on.
        Raises ``EngineNotReadyError`` while asleep or while weights are missing.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load weights given under their Hugging Face on-disk names (``model.layers.0.self_attn.q_proj.weight``;
        per-expert MoE names such as ``model.layers.0.mlp.experts.3.gate_proj.weight``).

        The iterable is consumed lazily, so a generator may stream buckets; it may cover only some
        weights. ``version`` (never lower than the current one) is committed only when the iterable
        is exhausted without error. An unknown name raises ``UnknownWeightError`` naming it; a wrong
        shape raises ``ValueError``. If an update fails after writing some tensors, ``generate``
        refuses to run until a later ``update_weights`` completes.
        """
        ...

    def weight_version(self) -> int:
        """The version of the last completed ``update_weights`` (0 for the initial checkpoint)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release memory. Level 1 keeps the weights (offloaded to host); level 2 drops them, so every
        weight must be re-sent with ``update_weights`` before generating again."""
        ...

    def wake(self) -> None:
        """Undo ``sleep``: weights kept by level 1 come back to the device."""
        ...

    def pause_generation(self) -> None:
        """Interrupt generation, for a weight update in the middle of asynchronous rollouts. Returns at once,
        from any thread, and is idempotent.

        Every running ``generate`` call returns at its next decoding step: its unfinished responses have
        ``finish_reason == "abort"`` and hold the tokens and log-probs generated so far (possibly none);
        responses that had finished keep "stop" / "length". Every ``generate`` call made while paused returns
        at once with all responses "abort" and empty. A call never spans a weight update, so
        ``weight_version`` is the version the call ran with; to continue a response, the caller resubmits
        prompt + partial response after ``resume_generation()``.
        """
        ...

    def resume_generation(self) -> None:
        """Undo ``pause_generation``: later ``generate`` calls run normally. Idempotent."""
        ...

    def health(self) -> dict:
        """A JSON-serialisable status report; ``health()["ready"]`` says whether ``generate`` will run,
        ``health()["paused"]`` whether ``pause_generation`` is in effect."""
        ...

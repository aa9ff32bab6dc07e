"""What the vLLM and SGLang adapters share: request checks, per-sample seeds, the checkpoint's weight
names, the engine lock and the answer of a paused engine, the MoE layers and the conversion of an engine's
routed experts to ``Generation.routing``, and ``EngineAdapter``, the protocol's logic around a handful of
engine calls.

Nothing here imports vLLM or SGLang; the adapters keep every engine call in their own module. ``HFEngine``
uses the request checks, the lock and the weight-update steps (``rlmega.rollout.weight_updates``) too, so
all three engines follow the same rules and messages.
"""

from __future__ import annotations

import difflib
import json
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
from safetensors import safe_open

from rlmega.rollout.fp8_weights import check_weight_dtype, for_fp8_checkpoint, is_fp8_checkpoint, write_fp8_checkpoint
from rlmega.rollout.lora_serving import ServedAdapter
from rlmega.rollout.protocol import FinishReason, Generation, SamplingParams, UnknownWeightError
from rlmega.rollout.sampling import request_generator
from rlmega.rollout.weight_group import DEFAULT_GROUP_NAME, WeightMeta
from rlmega.rollout.engine_lock import runs_model, serialised
from rlmega.rollout.weight_updates import UpdateSteps, WeightBook, WeightUpdates, check_shape
from rlmega.data.schema import ImageInputs

DEFAULT_BUCKET_BYTES = 256 * 1024**2
# How long a weight update waits for the engine to drop its prefix cache (it refuses while requests hold KV).
PREFIX_CACHE_TIMEOUT_S = 60.0


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.11.0"`` -> ``(0, 11, 0)``; local and pre-release tails (``0.11.1rc2.dev3+g1a2b``) are dropped."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def check_version(package: str, installed: str, minimum: tuple[int, ...], below: tuple[int, ...]) -> None:
    """Raise ``RuntimeError`` naming both versions unless ``minimum <= installed < below``."""
    if not minimum <= version_tuple(installed) < below:
        supported = f">={'.'.join(map(str, minimum))},<{'.'.join(map(str, below))}"
        raise RuntimeError(
            f"{package} {installed} is installed, but rlmega's {package} adapter supports {package}{supported} "
            f"(the `{package}` extra of setup.py); install a supported version or update the adapter's API section")


# ---------------------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class ModelFacts:
    """What the adapters need to know of the checkpoint, read from its config files."""

    vocab_size: int
    max_positions: int | None
    eos_token_ids: frozenset[int]  # ids the engine may stop on by itself (config.json and generation_config.json)
    tie_word_embeddings: bool
    num_layers: int = 0  # decoder layers (num_hidden_layers)
    moe_layers: tuple[int, ...] = ()  # 0-based indices of the MoE decoder layers, in order
    experts_per_token: int = 0  # top-k of the MoE layers (num_experts_per_tok)
    image_token_id: int | None = None  # a vision-language model's image pad token (None: text only)
    spatial_merge_size: int = 2  # vision_config: patches merged per side into one image token
    patch_size: int = 14  # vision_config: pixels per patch side

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ModelFacts:
        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        text = config.get("text_config", config)  # multimodal configs nest the language model's
        eos: set[int] = set()
        vision = config.get("vision_config")
        for source in (text, config, _read_json(directory / "generation_config.json")):
            value = source.get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        return cls(vocab_size=text["vocab_size"],
                   max_positions=text.get("max_position_embeddings", text.get("n_positions")),
                   eos_token_ids=frozenset(eos),
                   tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
                   num_layers=text.get("num_hidden_layers", 0),
                   moe_layers=tuple(moe_layer_indices(text)),
                   experts_per_token=text.get("num_experts_per_tok") or 0,
                   image_token_id=config.get("image_token_id") if vision else None,
                   spatial_merge_size=(vision or {}).get("spatial_merge_size", 2),
                   patch_size=(vision or {}).get("patch_size", 14))


def moe_layer_indices(text_config: dict) -> list[int]:
    """The 0-based indices of the decoder layers that are MoE layers, from a (text) ``config.json``.

    The rules of transformers and of the engines' model code (vLLM 0.33 ``deepseek_v2.py`` /
    ``qwen3_moe.py``, SGLang 0.5.23 ``deepseek_v2.py``; SGLang's ``qwen3_moe.py`` builds every layer
    sparse, so it cannot load a Qwen3-MoE checkpoint with dense layers at all): DeepSeek layer ``i`` is MoE
    iff ``n_routed_experts`` and ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``; Qwen-MoE
    layer ``i`` iff ``num_experts``, ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
    every layer of a model with ``num_local_experts`` (Mixtral, gpt-oss)."""
    layers = text_config.get("num_hidden_layers", 0)
    if "n_routed_experts" in text_config:
        if not text_config["n_routed_experts"]:
            return []
        first_moe = text_config.get("first_k_dense_replace") or 0
        every = text_config.get("moe_layer_freq") or 1
        return [i for i in range(layers) if i >= first_moe and i % every == 0]
    if not (text_config.get("num_experts") or text_config.get("num_local_experts")):
        return []
    dense = set(text_config.get("mlp_only_layers") or ())
    step = text_config.get("decoder_sparse_step") or 1
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def check_routable(facts: ModelFacts) -> None:
    """``record_routing`` needs MoE layers (the same refusal as ``HFEngine``'s)."""
    if not facts.moe_layers or facts.experts_per_token < 1:
        raise ValueError("routing is recorded for MoE models; this model has no MoE layers")


def routing_in_convention(captured: np.ndarray, moe_layers: Sequence[int], num_tokens: int) -> torch.Tensor:
    """An engine's routed experts -> the protocol's ``[P + R, M, k]`` int16 (``Generation.routing``).

    ``captured`` is ``[T, L, k]``: the experts of the first ``T`` tokens of prompt + response in every
    decoder layer (a dense layer's rows hold nothing). Both engines return ``T = P + R_engine - 1``: every
    token fed through the model, never the last sampled one. ``num_tokens`` is ``P + R`` after the
    response was cut (``finish_response``): rows ``[0, P + R - 1)`` are kept, the MoE layers selected in
    order, and the last token repeats the row before (as ``HFEngine``). A response cut before the end
    of what the engine generated drops the rest.
    """
    captured = np.asarray(captured)
    if captured.ndim != 3 or captured.shape[0] < num_tokens - 1:
        raise RuntimeError(f"the engine returned routed experts of shape {tuple(captured.shape)}; expected "
                           f"[>= {num_tokens - 1}, layers, k] for {num_tokens} tokens")
    if max(moe_layers) >= captured.shape[1]:
        raise RuntimeError(f"the engine returned routed experts for {captured.shape[1]} layers; the MoE layers "
                           f"are {list(moe_layers)}")
    rows = torch.from_numpy(captured[:num_tokens - 1][:, list(moe_layers)].astype(np.int16))
    return torch.cat([rows, rows[-1:]])


class EngineResponse(NamedTuple):
    """One engine request's answer, as an adapter's ``_engine_generate`` returns it."""

    tokens: list[int]
    logprobs: list[float]
    aborted: bool  # ``_engine_interrupt`` cut the request short
    routed_experts: Optional[np.ndarray] = None  # [T, L, k] in the engine's layout (``routing_in_convention``)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def check_requests(prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                   vocab_size: int, max_positions: int | None) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt, after checking the prompts against the model (every engine's
    checks and messages)."""
    if isinstance(params, SamplingParams):
        per_prompt = [params] * len(prompts)
    else:
        per_prompt = list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        for p in per_prompt:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size})")
    for index, (prompt, p) in enumerate(zip(prompts, per_prompt)):
        if any(token >= vocab_size for token in p.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids {p.stop_token_ids} has ids >= the "
                             f"vocabulary size {vocab_size}")
        if max_positions is not None and len(prompt) + p.max_new_tokens > max_positions:
            raise ValueError(f"prompt {index} ({len(prompt)} tokens) + max_new_tokens {p.max_new_tokens} "
                             f"exceeds the model's max_position_embeddings {max_positions}")
    return per_prompt


def sample_requests(per_prompt: list[SamplingParams]) -> list[tuple[int, int]]:
    """``(prompt_index, sample_index)`` of every response, prompt-major.

    The adapters send each response as its own engine request with ``n=1``: both engines give the n
    children of one request seeds that collide across prompts (vLLM: ``seed + index``; SGLang: the same
    seed), and vLLM refuses ``n > 1`` when greedy. One request per sample keeps the protocol's seeding.
    """
    return [(i, j) for i, p in enumerate(per_prompt) for j in range(p.n)]


def sample_seed(seed: int | None, prompt_index: int, sample_index: int) -> int | None:
    """The seed of one response: the same 63-bit mix of ``(seed, prompt, sample)`` that ``HFEngine`` uses."""
    if seed is None:
        return None
    return request_generator(seed, prompt_index, sample_index, torch.device("cpu")).initial_seed()


def finish_response(tokens: list[int], logprobs: list[float], stop_token_ids: Iterable[int],
                    max_new_tokens: int, aborted: bool = False) -> tuple[list[int], list[float], FinishReason]:
    """Cut a response after its first stop token, and name why it ended.

    Both engines test the length limit before the stop tokens, so a stop token drawn as the last allowed
    token is reported as "length" by them; the protocol calls it "stop". An ``aborted`` response is
    "abort" unless it is complete anyway (SGLang tests the abort before the stop and length rules).
    """
    if len(tokens) != len(logprobs):
        raise RuntimeError(f"the engine returned {len(tokens)} tokens but {len(logprobs)} log-probs")
    stops = set(stop_token_ids)
    for position, token in enumerate(tokens):
        if token in stops:
            return tokens[:position + 1], logprobs[:position + 1], "stop"
    if len(tokens) == max_new_tokens:
        return tokens, logprobs, "length"
    if aborted:
        return tokens, logprobs, "abort"
    raise RuntimeError(f"the engine ended a response after {len(tokens)} of {max_new_tokens} tokens "
                       f"without a stop token")


def check_images(images: Sequence[ImageInputs | None] | None, prompts: list[list[int]],
                 facts: ModelFacts, model_type: str) -> list[ImageInputs | None] | None:
    """Per prompt its images (None: text only), or None when no prompt has any, after checking each prompt's
    pad tokens against its images: one run of ``grid.prod() // merge**2`` pad tokens per image, in order (the
    engines locate each image's features by these runs and raise deep inside, or misplace them, otherwise)."""
    if images is None or all(item is None for item in images):
        return None
    if facts.image_token_id is None:
        raise ValueError(f"images given, but this {model_type} model takes text only")
    images = list(images)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
    for index, (prompt, item) in enumerate(zip(prompts, images)):
        runs = image_token_runs(prompt, facts.image_token_id)
        if item is None:
            if runs:
                raise ValueError(f"prompt {index} has {len(runs)} image pad runs but no images")
            continue
        grid = item.grid_thw
        if grid.ndim != 2 or grid.shape[1] != 3 or item.pixel_values.shape[0] != int(grid.prod(-1).sum()):
            raise ValueError(f"prompt {index}: pixel_values {tuple(item.pixel_values.shape)} do not match "
                             f"grid_thw {grid.tolist()} (one row per patch)")
        expected = [int(g.prod()) // facts.spatial_merge_size**2 for g in grid]
        if [length for _, length in runs] != expected:
            raise ValueError(f"prompt {index} has image pad runs of {[length for _, length in runs]} tokens; its "
                             f"grid_thw {grid.tolist()} needs {expected} (the prompt must carry the expanded pad "
                             f"tokens, as rlmega.data.images.ImagePrompts writes them)")
        if item.images is not None and len(item.images) != len(expected):
            raise ValueError(f"prompt {index}: {len(item.images)} encoded images for {len(expected)} grids")
    return images


def image_token_runs(prompt: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``token_id`` in ``prompt``."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(prompt):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


# ---------------------------------------------------------------------------------------------- pause, lock

def paused_generations(per_prompt: list[SamplingParams], version: int) -> list[Generation]:
    """What ``generate`` returns while paused: every response, prompt-major, "abort" and empty."""
    return [Generation(prompt_index=i, response_token_ids=[], logprobs=[], finish_reason="abort",
                       weight_version=version) for i, _ in sample_requests(per_prompt)]


# ---------------------------------------------------------------------------------------------- weights

class CheckpointWeights:
    """The names and shapes of a checkpoint's tensors, read from its safetensors headers (no data).

    These are the names an engine's ``load_weights`` accepts. Checking every incoming tensor against
    them before it is sent matters: the engines raise bare ``KeyError``/``AssertionError`` deep in their
    loaders (SGLang in its scheduler process, which then dies).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], model_type: str = "unknown"):
        self.shapes = shapes  # on-disk name -> shape
        self._slot = {name: name for name in shapes} | aliases  # accepted name -> the on-disk name it fills
        self.model_type = model_type

    @classmethod
    def from_checkpoint(cls, directory: str | Path, facts: ModelFacts | None = None) -> CheckpointWeights:
        directory = Path(directory)
        facts = facts or ModelFacts.from_checkpoint(directory)
        shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {directory}: the adapters need a safetensors checkpoint")
        for file in files:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    shapes[name] = tuple(reader.get_slice(name).get_shape())
        aliases = {}
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")), None)
        if facts.tie_word_embeddings and "lm_head.weight" not in shapes and embed is not None:
            aliases["lm_head.weight"] = embed  # the engines load a tied head into the embedding
        model_type = json.loads((directory / "config.json").read_text()).get("model_type", "unknown")
        return cls(shapes, aliases, model_type)

    def check(self, name: str, tensor: torch.Tensor) -> str:
        """The on-disk name that ``name`` fills; raises ``UnknownWeightError`` or ``ValueError`` (bad shape)."""
        slot = self._slot.get(name)
        if slot is None:
            close = difflib.get_close_matches(name, self._slot, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownWeightError(f"unknown weight name {name!r}: not a weight of this {self.model_type} "
                                     f"checkpoint{hint}")
        check_shape(name, tensor, self.shapes[slot])
        return slot


def checked_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], weights: CheckpointWeights,
                    bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], set[str]]]:
    """``(bucket, on-disk names it fills)``, each bucket about ``bucket_bytes``; every tensor is checked
    as it arrives, so a bad one raises before the bucket holding it is sent. Tensors are cloned because a
    streaming producer may reuse its buffers for the next bucket."""
    bucket, slots, size = [], set(), 0
    for name, tensor in named_tensors:
        slots.add(weights.check(name, tensor))
        bucket.append((name, tensor.detach().clone()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket, slots
            bucket, slots, size = [], set(), 0
    if bucket:
        yield bucket, slots


# ---------------------------------------------------------------------------------------------- adapters

def adapter_settings(adapter: str, user_kwargs: dict, settings: dict) -> dict:
    """The engine's arguments: the caller's, plus the adapter's own ``settings``, which may not be changed."""
    clashes = {key for key, value in settings.items() if key in user_kwargs and user_kwargs[key] != value}
    if clashes:
        raise ValueError(f"{adapter} sets {sorted(clashes)} itself ({ {k: settings[k] for k in sorted(clashes)} })")
    return {**user_kwargs, **settings}


class EngineAdapter(UpdateSteps, ABC):
    """``RolloutEngine`` over an external engine that loads the checkpoint format: everything but the
    engine calls, which a subclass supplies as the abstract ``_engine_*`` methods (each a call into its
    module's version-gated API section).

    ``model`` is a local Hugging Face checkpoint directory (safetensors): its headers give the weight names
    and shapes that ``update_weights`` checks before anything reaches the engine. Responses are sent one
    engine request each (see ``sample_requests``); buckets of about ``bucket_bytes`` are sent with one
    engine call each. ``sleep`` frees the weights and the KV cache; writing weights wakes the weights alone
    (memory must be mapped to be written), and ``wake()`` brings back the rest, weights before KV cache.
    Engine calls are serialised (``serialised``); ``pause_generation`` asks the engine to interrupt a running
    call through ``_engine_interrupt``, which each adapter implements as far as its engine allows.
    An engine that serves LoRA adapters (``sync.lora=adapters``) sets ``_adapters``: an update's adapter tensors are
    kept apart from its base weights and loaded at the commit (``rlmega.rollout.lora_serving``).
    """

    engine_name: str  # health()["engine"]

    def __init__(self, model: str | Path, *, bucket_bytes: int, engine_version: str, record_routing: bool = False,
                 weight_dtype: str = "auto"):
        check_weight_dtype(weight_dtype)
        self.model_path = Path(model)
        self._fp8_copy: tempfile.TemporaryDirectory | None = None
        if weight_dtype == "fp8" and not is_fp8_checkpoint(self.model_path):
            # The engines build block-FP8 layers only for an FP8 checkpoint (its quantization_config and
            # weight_scale_inv tensors): start them from a quantized copy, removed with the adapter.
            self._fp8_copy = tempfile.TemporaryDirectory(prefix="rlmega-fp8-")
            self.model_path = write_fp8_checkpoint(self.model_path, self._fp8_copy.name)
        self.facts = ModelFacts.from_checkpoint(self.model_path)
        if record_routing:
            check_routable(self.facts)
        self.record_routing = record_routing
        self.weights = CheckpointWeights.from_checkpoint(self.model_path, self.facts)
        self.bucket_bytes = bucket_bytes
        self._engine_version = engine_version
        self._book = WeightBook(self.weights.shapes)
        self._updates = WeightUpdates(self._book, checked_buckets=self._checked_buckets, load=self._load_bucket,
                                      committed=self._committed)
        self._asleep_tags: set[str] = set()  # of "weights", "kv_cache"
        self._group_name = DEFAULT_GROUP_NAME
        self._group_joined = False
        self._update_open = False  # the engine's own update session (_engine_open_update) is open
        self._lock = threading.RLock()
        self._paused = threading.Event()
        self._adapters: Optional[ServedAdapter] = None

    # ------------------------------------------------------------------ engine calls

    @abstractmethod
    def _engine_generate(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None],
                         images: list[ImageInputs | None] | None = None) -> list[EngineResponse]:
        """One request per prompt, with its params and seed (and its images, checked by ``check_images``;
        None: no request has any), in order; with ``record_routing``, each response that reached the model
        carries its routed experts."""

    @abstractmethod
    def _engine_interrupt(self, paused: threading.Event) -> None:
        """Called from any thread by ``pause_generation`` (``paused`` is set): make a running
        ``_engine_generate`` return soon, its unfinished requests aborted."""

    @abstractmethod
    def _engine_load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Load a checked bucket of on-disk named tensors into every worker."""

    @abstractmethod
    def _engine_join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> None:
        """Join every worker to the weight-update group (worker ``w`` as rank ``rank_offset + w``)."""

    @abstractmethod
    def _engine_receive(self, metas: list[WeightMeta], group_name: str) -> None:
        """Receive and load the broadcast bucket that ``metas`` describe (not empty)."""

    @abstractmethod
    def _engine_leave_group(self, group_name: str) -> None:
        """Destroy the weight-update group on every worker."""

    def _engine_open_update(self) -> None:
        """Open the engine's own weight-update session before the first bucket of an update (vLLM's
        ``start_weight_update``, SGLang's ``begin_weight_update``)."""

    def _engine_close_update(self, version: int) -> None:
        """Close the session ``_engine_open_update`` opened, at the commit of ``version``."""

    @abstractmethod
    def _engine_drop_prefix_cache(self) -> bool:
        """Drop cached KV: it was computed with the old weights. False: the engine kept it (requests still hold
        KV blocks), so the caller tries again."""

    @abstractmethod
    def _engine_sleep(self, level: int) -> None:
        """Free the weights and the KV cache (the weights kept in host memory when ``level`` is 1)."""

    @abstractmethod
    def _engine_wake(self, tags: list[str]) -> None:
        """Bring back ``tags`` (of "weights", "kv_cache"), in that order."""

    # ------------------------------------------------------------------ generation

    @runs_model
    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        """See ``RolloutEngine.generate``. One engine request per response (see ``sample_requests``).
        ``images``: a vision-language model's images of each prompt (None: text only), as ``HFEngine`` takes
        them; each prompt already holds its expanded image pad tokens."""
        images = check_images(images, prompts, self.facts, self.weights.model_type)
        if self._paused.is_set():  # at once, even while an update holds the lock
            return paused_generations(check_requests(prompts, params, self.facts.vocab_size,
                                                     self.facts.max_positions), self._book.version)
        with self._lock:
            self._book.check_ready()
            per_prompt = check_requests(prompts, params, self.facts.vocab_size, self.facts.max_positions)
            if self._paused.is_set():  # paused while this call waited for the lock
                return paused_generations(per_prompt, self._book.version)
            requests = sample_requests(per_prompt)
            if not requests:
                return []
            responses = self._engine_generate([prompts[i] for i, _ in requests],
                                              [per_prompt[i] for i, _ in requests],
                                              [sample_seed(per_prompt[i].seed, i, j) for i, j in requests],
                                              None if images is None else [images[i] for i, _ in requests])
            generations = []
            for (i, _), response in zip(requests, responses):
                p = per_prompt[i]
                tokens, logprobs, reason = finish_response(response.tokens, response.logprobs, p.stop_token_ids,
                                                           p.max_new_tokens, response.aborted)
                generations.append(Generation(prompt_index=i, response_token_ids=tokens, logprobs=logprobs,
                                              finish_reason=reason, weight_version=self._book.version,
                                              routing=self._routing(response, len(prompts[i]) + len(tokens))))
            return generations

    def _routing(self, response: EngineResponse, num_tokens: int) -> Optional[torch.Tensor]:
        """``Generation.routing`` of one response: None unless recording; None for a response aborted before
        the model saw it (SGLang returns nothing for a request aborted while queued)."""
        if not self.record_routing:
            return None
        if response.routed_experts is None or (response.aborted and len(response.routed_experts) == 0):
            if response.aborted:
                return None
            raise RuntimeError(f"{self.engine_name} returned no routed experts for a finished response")
        return routing_in_convention(response.routed_experts, self.facts.moe_layers, num_tokens)

    def pause_generation(self) -> None:
        """See ``RolloutEngine.pause_generation``; how far a running call is interrupted depends on the
        engine (``_engine_interrupt``)."""
        if not self._paused.is_set():
            self._paused.set()
            self._engine_interrupt(self._paused)

    def resume_generation(self) -> None:
        self._paused.clear()

    # ------------------------------------------------------------------ weights, colocated

    @serialised
    def begin_update(self, version: int) -> None:
        super().begin_update(version)
        if self._adapters is not None:
            self._adapters.begin()

    @serialised
    def commit_update(self) -> None:
        """An update that brought an adapter has the engine load it before the version commits (if that fails, the
        update is left torn)."""
        if self._adapters is not None and self._adapters.has_pending():
            self._book.sending()
            self._adapters.serve(self._book.pending)
        super().commit_update()

    def _checked_buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        if self._adapters is not None:
            named_tensors = self._adapters.take(named_tensors)
        return checked_buckets(for_fp8_checkpoint(named_tensors, self.weights.shapes), self.weights,
                               self.bucket_bytes)

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._prepare_engine()
        self._engine_load(bucket)

    def _committed(self, version: int) -> None:
        if self._update_open:
            self._engine_close_update(version)
            self._update_open = False
        if "kv_cache" not in self._asleep_tags:
            self._drop_prefix_cache(version)

    def _drop_prefix_cache(self, version: int) -> None:
        """Both engines refuse to drop their prefix cache while requests hold KV blocks (and say so only in their
        return value); the next requests would then reuse KV computed with the old weights, silently. So the drop
        is tried until the engine is idle, for ``PREFIX_CACHE_TIMEOUT_S``; if it never succeeds the version is
        marked torn (``generate`` refuses) and the update fails naming the engine."""
        deadline, wait = time.monotonic() + PREFIX_CACHE_TIMEOUT_S, 0.01
        while not self._engine_drop_prefix_cache():
            if time.monotonic() >= deadline:
                self._book.torn_version = version
                raise RuntimeError(
                    f"the {self.engine_name} engine of {self.model_path} kept its prefix cache after the update to "
                    f"weight version {version} for {PREFIX_CACHE_TIMEOUT_S:g} s (requests still held KV blocks), so "
                    "its next generations would reuse KV of the old weights; it refuses to generate until an update "
                    "completes: update it again once its requests have finished")
            time.sleep(wait)
            wait = min(2 * wait, 1.0)

    # ------------------------------------------------------------------ weights, disaggregated

    @serialised
    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> None:
        """Join every worker to the trainer's weight group (worker ``w`` as rank ``rank_offset + w``).
        Collective: the trainer rank calls ``weight_group.init_weight_update_group(..., rank=0)`` meanwhile."""
        self._engine_join_group(master_address, master_port, rank_offset, world_size, group_name, backend)
        self._group_name, self._group_joined = group_name, True

    @serialised
    def destroy_weight_update_group(self) -> None:
        if self._group_joined:
            self._engine_leave_group(self._group_name)
            self._group_joined = False

    @serialised
    def receive_weights(self, metas: Sequence[WeightMeta]) -> None:
        """Receive one bucket that the trainer rank broadcasts (``weight_group.broadcast_weights``), between
        ``begin_update`` and ``commit_update``. ``metas`` are ``weight_group.weight_meta(bucket)``."""
        if not self._group_joined:  # SGLang's receiver asserts on an unknown group (in 0.5.3, killing the scheduler)
            raise RuntimeError("receive_weights needs a weight-update group: call init_weight_update_group first")
        metas = [(name, dtype, tuple(shape)) for name, dtype, shape in metas]
        slots = {self.weights.check(name, torch.empty(shape, device="meta")) for name, _, shape in metas}
        for name, dtype, _ in metas:  # a broadcast goes to the engine's loader as it is: nothing can quantize it
            if dtype != "float8_e4m3fn" and name + "_scale_inv" in self.weights.shapes:
                raise ValueError(f"weight {name!r} arrives as {dtype}, but this engine serves it in FP8: broadcast "
                                 "it as float8_e4m3fn followed by its _scale_inv (rlmega.bridge.fp8.quantized_buckets)")
        if not metas:
            return
        with self._updates.sending(slots):
            self._prepare_engine()
            self._engine_receive(metas, self._group_name)

    def _prepare_engine(self) -> None:
        """Before a bucket reaches the engine: its weights mapped, its update session open."""
        self._wake_weights()
        if not self._update_open:
            self._engine_open_update()
            self._update_open = True

    def weight_version(self) -> int:
        return self._book.version

    # ------------------------------------------------------------------ memory

    @serialised
    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache. Level 2 requires every weight to be re-sent. Deeper while
        asleep only deepens the bookkeeping (the engines cannot re-sleep)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if not self._asleep_tags and self._book.sleep_level == 0:
            self._engine_sleep(level)
            self._asleep_tags = {"weights", "kv_cache"}
        self._book.slept(level)

    @serialised
    def wake(self) -> None:
        """Bring back whatever is still asleep, weights first."""
        if self._asleep_tags:
            self._engine_wake(sorted(self._asleep_tags, key=["weights", "kv_cache"].index))
            self._asleep_tags.clear()
        self._book.sleep_level = 0

    def _wake_weights(self) -> None:
        """Weights cannot be written while their memory is unmapped; the KV cache may stay asleep."""
        if "weights" in self._asleep_tags:
            self._engine_wake(["weights"])
            self._asleep_tags.discard("weights")

    def health(self) -> dict:
        return {
            **self._book.health(),
            "asleep": sorted(self._asleep_tags),
            "paused": self._paused.is_set(),
            "engine": self.engine_name,
            "engine_version": self._engine_version,
            "model_type": self.weights.model_type,
        }

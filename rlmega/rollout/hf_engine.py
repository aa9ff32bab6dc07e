"""A rollout engine on a transformers causal LM: batched generation with a KV cache, in-process.

Slow next to vLLM or SGLang, but exact and dependency-free: the reference engine for tests and small
runs. The sampling loop is our own (not ``model.generate``) so each request has its own sampling
settings and generator; the returned log-probs are those of the temperature-scaled logits.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
from collections.abc import Iterable, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache, PreTrainedModel

from rlmega.bridge.fp8 import fp8_rounded, is_quantized
from rlmega.rollout.engine_common import check_requests, paused_generations
from rlmega.rollout.fp8_weights import check_weight_dtype, is_fp8_checkpoint, load_fp8_checkpoint, served_stream
from rlmega.rollout.engine_lock import runs_model, serialised
from rlmega.rollout.hf_routing import RoutingRecorder, routing_or_none
from rlmega.rollout.hf_weights import HFWeightMap, WeightTarget
from rlmega.models.vision_language import VISION_LANGUAGE_MODEL_TYPES, mrope_positions, vision_spec_from_hf
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.data.schema import ImageInputs
from rlmega.rollout.sampling import RowSampling, request_generator, select_next_tokens
from rlmega.rollout.weight_updates import UpdateSteps, WeightBook, WeightUpdates, check_shape

PAD_TOKEN_ID = 0  # left padding is masked out, so any in-vocabulary id works


def left_pad(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` with each sequence right-aligned, L the longest."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        input_ids[row, length - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, length - len(tokens):] = 1
    return input_ids.to(device), attention_mask.to(device)


class HFEngine(UpdateSteps):
    """Implements ``RolloutEngine`` on a Hugging Face model.

    ``model`` is a checkpoint directory (loaded with ``attn_implementation`` if given) or a loaded
    model, which the engine then owns: it is moved to ``device``/``dtype`` and its weights are
    overwritten by ``update_weights``. Safe to call from several threads: generation and weight changes
    run one at a time (``serialised``), and ``pause_generation`` stops a running ``generate`` between
    two decoding steps. ``weight_dtype="fp8"``: the engine serves its linear weights as blockwise FP8
    (``rlmega.rollout.fp8_weights``); FP8 updates (weight + ``_scale_inv``) are accepted either way.
    """

    def __init__(self, model: str | os.PathLike | PreTrainedModel, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attn_implementation: str | None = None,
                 weight_noise_std: float = 0.0, record_routing: bool = False, weight_dtype: str = "auto"):
        check_weight_dtype(weight_dtype)
        if isinstance(model, (str, os.PathLike)):
            extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
            vision_language = AutoConfig.from_pretrained(model).model_type in VISION_LANGUAGE_MODEL_TYPES
            loader = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
            if is_fp8_checkpoint(model):
                model = load_fp8_checkpoint(model, loader, dtype, **extra)
            else:
                model = loader.from_pretrained(model, dtype=dtype, **extra)
        elif model.dtype != dtype:
            model = model.to(dtype)
        self.device = torch.device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.dtype = dtype
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings
        self.max_positions: int | None = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self._weights = HFWeightMap(self.model)
        self.vision = (vision_spec_from_hf(self.model.config.to_dict())
                       if self.model.config.model_type in VISION_LANGUAGE_MODEL_TYPES else None)
        # transformers renamed the forward's cache argument from past_key_values to cache during 5.x.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Versions, torn updates, sleep level (0 awake; 1 weights on host; 2 weights dropped) and the
        # on-disk names not re-sent since sleep(level=2).
        self._book = WeightBook(self._weights.slots)
        self._updates = WeightUpdates(self._book, checked_buckets=self._checked_tensors, load=self._write)
        self._dropped: set[str] = set()  # tensors whose storage sleep(level=2) freed
        self._lock = threading.RLock()
        self._paused = threading.Event()  # checked between decoding steps
        # Gaussian noise of this std is added to every weight loaded: an engine that deliberately serves
        # slightly different weights than the trainer's, to study the train-inference mismatch on CPU.
        # MoE routing replay (R3): every generation carries the experts its tokens went to.
        self._routing = RoutingRecorder(self.model) if record_routing else None
        self._noise_std = weight_noise_std
        self._noise = torch.Generator(device=self.device).manual_seed(0)
        # "fp8": serve every quantizable weight as an FP8 engine does (blockwise FP8, dequantized for the
        # computation), from the checkpoint on, to show the FP8 rollout's train-inference mismatch on CPU.
        self._fp8 = weight_dtype == "fp8"
        if self._fp8:
            self._round_weights_through_fp8()
        if weight_noise_std:
            for weight in self._weights.tensors.values():
                self._perturb(weight.data)

    # ------------------------------------------------------------------ generation

    @runs_model
    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        """See ``RolloutEngine.generate``. All responses are decoded together, one token per step; a pause
        takes effect before the next step. ``images``: a vision-language model's images of each prompt (None:
        text only), their pad tokens already in the prompt."""
        if self._paused.is_set():  # at once, even while an update holds the lock
            return paused_generations(check_requests(prompts, params, self.vocab_size, self.max_positions),
                                      self._book.version)
        with self._lock:
            return self._generate(prompts, params, images)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                  images: Sequence[ImageInputs | None] | None) -> list[Generation]:
        self._book.check_ready()
        per_prompt = check_requests(prompts, params, self.vocab_size, self.max_positions)
        requests = [(i, j) for i, p in enumerate(per_prompt) for j in range(p.n)]
        if not requests:
            return []
        row_params = [per_prompt[i] for i, _ in requests]
        rows = RowSampling.build(
            row_params, [request_generator(per_prompt[i].seed, i, j, self.device) for i, j in requests],
            self.vocab_size, self.device)
        # A text model reads each prompt once and its n rows share that prefill (its KV cache and last logits):
        # the prompt's work is done once, not n times. A vision-language model's rows each carry their images, and
        # MoE routing is recorded per row: those prefill every row.
        prefilled = sorted({i for i, _ in requests}) if self.vision is None and self._routing is None else None
        share = prefilled is not None and len(prefilled) < len(requests)
        expand = None  # each row's row in the prefill
        if share:
            row_of = {prompt: row for row, prompt in enumerate(prefilled)}
            expand = torch.tensor([row_of[i] for i, _ in requests], device=self.device)
        input_ids, attention_mask = left_pad([prompts[i] for i in prefilled] if share else
                                             [prompts[i] for i, _ in requests], self.device)
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # pads sit at 0; they are masked
        inputs = {}
        if self.vision is not None:
            position_ids, inputs = self._multimodal_prefill(prompts, images, requests, position_ids)
        elif images is not None and any(item is not None for item in images):
            raise ValueError(f"images given, but this {self.model.config.model_type} model takes text only")
        cache = DynamicCache(config=self.model.config)

        responses: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        stop_sets = [set(p.stop_token_ids) for p in row_params]
        with self._routing if self._routing is not None else contextlib.nullcontext():
            self._decode(input_ids, attention_mask, position_ids, cache, rows, row_params, stop_sets, responses,
                         logprobs, finish, inputs, expand)
        routing = routing_or_none(self._routing, len(requests), [len(prompts[i]) for i, _ in requests],
                                  [len(response) for response in responses])
        return [Generation(prompt_index=i, response_token_ids=responses[row], logprobs=logprobs[row],
                           finish_reason=finish[row], weight_version=self._book.version, routing=routing[row])
                for row, (i, _) in enumerate(requests)]

    def _multimodal_prefill(self, prompts, images, requests, position_ids):
        """A vision-language model's ``[3, B, L]`` positions of the left-padded prompts and the rows' images
        (each sample of a prompt gets its own copy), for the first forward pass."""
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        multimodal = position_ids.unsqueeze(0).repeat(3, 1, 1)
        pixels, grids = [], []
        for row, (i, _) in enumerate(requests):
            item = images[i]
            positions = mrope_positions(torch.tensor(prompts[i]), None if item is None else item.grid_thw, self.vision)
            multimodal[:, row, multimodal.shape[-1] - positions.shape[1]:] = positions.to(self.device)
            if item is not None:
                pixels.append(item.pixel_values)
                grids.append(item.grid_thw)
        if not pixels:
            return multimodal, {}
        return multimodal, {"pixel_values": torch.cat(pixels).to(self.device, self.dtype),
                            "image_grid_thw": torch.cat(grids).to(self.device)}

    def _decode(self, input_ids, attention_mask, position_ids, cache, rows, row_params, stop_sets, responses,
                logprobs, finish, inputs=None, expand=None) -> None:
        """One token per row per step until every row stopped, reached its length, or a pause came. ``inputs``:
        what the first step also takes (a vision-language model's images); ``expand``: each row's row among the
        first step's (the prompts read once, then shared by their rows), or None when they are the rows."""
        inputs = dict(inputs or {})
        if position_ids.dim() == 3:  # multimodal: text after the prompt continues from its largest position
            next_position = position_ids.amax(dim=(0, 2)).view(1, -1, 1) + 1
        for _ in range(max(p.max_new_tokens for p in row_params)):
            if self._paused.is_set():
                finish[:] = [reason or "abort" for reason in finish]
                break
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, logits_to_keep=1, **{self._cache_arg: cache}, **inputs).logits[:, -1]
            inputs = {}
            if expand is not None:  # after the prefill: every row gets its prompt's cache, logits and positions
                cache.reorder_cache(expand)
                logits, attention_mask, position_ids = (t.index_select(0, expand)
                                                        for t in (logits, attention_mask, position_ids))
                expand = None
            tokens, token_logprobs = select_next_tokens(logits, rows)
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                if finish[row] is not None:
                    continue  # finished rows keep decoding in the batch; their tokens are ignored
                responses[row].append(token)
                logprobs[row].append(logprob)
                if token in stop_sets[row]:
                    finish[row] = "stop"
                elif len(responses[row]) == row_params[row].max_new_tokens:
                    finish[row] = "length"
            if all(reason is not None for reason in finish):
                break
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(responses), 1))], dim=-1)
            if position_ids.dim() == 3:
                position_ids, next_position = next_position.expand(3, -1, -1), next_position + 1
            else:
                position_ids = position_ids[:, -1:] + 1

    # ------------------------------------------------------------------ weights

    def _checked_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Each tensor a bucket of its own, checked as it arrives: nothing of the stream is held beyond it (an FP8
        weight until its scales, which follow it)."""
        for name, tensor in served_stream(named_tensors, fp8=self._fp8):
            target = self._weights.resolve(name)
            check_shape(name, tensor, target.shape)
            yield (target, tensor), target.slots

    @torch.no_grad()
    def _write(self, bucket: tuple[WeightTarget, torch.Tensor]) -> None:
        target, tensor = bucket
        weight = self._weights.tensors[target.tensor_name]
        if target.tensor_name in self._dropped:  # re-allocate where it lives; wake() moves it to the device
            weight.data = torch.empty(self._weights.shapes[target.tensor_name], dtype=weight.dtype,
                                      device=weight.device)
            self._dropped.discard(target.tensor_name)
        weight.data[target.index].copy_(tensor)
        if self._noise_std:
            self._perturb(weight.data[target.index])

    @torch.no_grad()
    def _round_weights_through_fp8(self) -> None:
        for slot in self._weights.slots:
            target = self._weights.resolve(slot)
            if is_quantized(slot, target.shape):
                region = self._weights.tensors[target.tensor_name].data[target.index]
                region.copy_(fp8_rounded(region))

    def _perturb(self, weight: torch.Tensor) -> None:
        noise = torch.randn(weight.shape, generator=self._noise, device=weight.device, dtype=torch.float32)
        weight.add_(noise.mul_(self._noise_std).to(weight.dtype))

    def weight_version(self) -> int:
        return self._book.version

    def pause_generation(self) -> None:
        """See ``RolloutEngine.pause_generation``: a running ``generate`` stops before its next step."""
        self._paused.set()

    def resume_generation(self) -> None:
        self._paused.clear()

    # ------------------------------------------------------------------ memory

    @serialised
    def sleep(self, level: int = 1) -> None:
        """Level 1: weights move to host memory (on a CPU engine they already are, so nothing is freed)
        and are kept. Level 2: every weight's storage is freed; each must be re-sent with
        ``update_weights`` (before or after ``wake()``) before ``generate`` runs again. Non-persistent
        buffers (rotary frequencies) are kept. Sleeping deeper is allowed; shallower is a no-op."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        freed = False
        if level == 1 and self._book.sleep_level == 0 and self.device.type != "cpu":
            for weight in self._weights.tensors.values():
                weight.data = weight.data.to("cpu")
            freed = True
        if level == 2 and self._book.sleep_level < 2:
            for weight in self._weights.tensors.values():
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
            self._dropped = set(self._weights.tensors)
            freed = True
        self._book.slept(level)
        if freed:  # a full collection costs ~0.2 s with transformers loaded: only when memory was let go
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @serialised
    def wake(self) -> None:
        """Bring kept (and re-synced) weights back to the device. Weights still dropped stay missing,
        and ``generate`` refuses until they are re-sent."""
        for weight in self._weights.tensors.values():
            weight.data = weight.data.to(self.device)
        self._book.sleep_level = 0

    def health(self) -> dict:
        return {
            **self._book.health(),
            "paused": self._paused.is_set(),
            "resident_weight_bytes": sum(t.numel() * t.element_size() for t in self._weights.tensors.values()),
            "model_type": self._weights.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

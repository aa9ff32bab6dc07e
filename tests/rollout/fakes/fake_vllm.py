"""A stand-in for the ``vllm`` package (0.33.0), installed as ``sys.modules["vllm"]`` by the tests.

Every ``LLM`` call is bound to the signature recorded from the 0.33.0 wheel (``api/vllm.json``, via
``api_snapshot.check_call``); engine arguments, ``SamplingParams`` and ``CompletionOutput`` fields and the
``logprobs_mode`` choices are checked against the recorded ones. ``LLM`` from vllm/entrypoints/llm.py and
vllm/entrypoints/rl/offline.py (``start_weight_update`` / ``finish_weight_update``, which need
``weight_transfer_config``),
``SamplingParams`` from vllm/sampling_params.py, ``CompletionOutput`` / ``RequestOutput`` from
vllm/outputs.py, ``Logprob`` from vllm/logprobs.py. Behaviour the adapter relies on is reproduced:
``n > 1`` with greedy is refused, children of an ``n > 1`` request get ``seed + index``, the
generation_config's EOS stops unless ``ignore_eos``, and the rules of ``api/rules.json`` (each cited there from the
wheel; every refusal's message is read from there): the stop tokens tested before the length limit, temperatures
above 2 refused and those in (0, 0.01) raised to 0.01, a ``sharded_rdt`` engine only on the Ray executor, a
multimodal model only with its tokenizer, a fused layer sent in part rebuilt from uninitialised memory at
``finish_weight_update``;
``logprobs_mode`` picks raw or processed log-probs, ``sleep`` is emulated with ``enable_sleep_mode`` (without
it vLLM frees nothing, which the fake does not emulate), and weights
slept through cannot be written until ``wake_up(tags=["weights"])``. ``enable_return_routed_experts`` is
refused where vllm/config/vllm.py refuses it (a dense model, prefix caching off, PP > 1) and fills every
``CompletionOutput.routed_experts`` in the format recorded from the wheel (``API["routed_experts"]``): numpy
``[P + R - 1, num_hidden_layers, k]``, each MoE layer at its decoder-layer index, uint8 up to 256 experts
(else uint16), from ``SamplingParams.routed_experts_prompt_start``. Every call is recorded in ``calls``.

Images, as recorded from the wheel (``api/vllm_multimodal.json``): a prompt's keys must be ``TokensPrompt`` keys
(vllm/inputs/llm.py), ``multi_modal_data`` modalities ``MultiModalDataBuiltins`` ones; an ``"image"`` entry is
PIL images (vllm/multimodal/parse.py; the fake emulates no arrays) or a dict that must carry every field of
``Qwen2VLMultiModalDataParser.embedding_fields`` (embeddings: pixel values are refused); ``mm_processor_kwargs``
may set only the recorded size kwargs. On a vision-language checkpoint (config.json ``image_token_id`` +
``vision_config``) the images go through transformers' Qwen2-VL image processor, and each image's ONE pad token
is replaced, in order, by ``grid.prod() // merge**2`` pads (the prompt replacement of qwen2_5_vl.py, which
vllm/multimodal/processing/processor.py applies to every prompt: an already expanded run is expanded again).
LoRA (``fake_vllm_lora``): with ``enable_lora`` the engine takes PEFT adapters by ``llm_engine.add_lora`` and
applies the one a ``generate(..., lora_request=...)`` names (``W + scale * B @ A``); ``vllm.lora.request`` is
``lora_request_module``, which a test installs in ``sys.modules`` beside the fake.

What the model then sees is in ``mm_requests`` (per ``generate`` call, per request: None or its expanded
``prompt_token_ids``, ``pixel_values`` and ``image_grid_thw``); ``RequestOutput.prompt_token_ids`` is expanded.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from . import api_snapshot
from .fake_vllm_lora import FakeLoRA, LoRARequest, request_module as lora_request_module  # noqa: F401
from .tiny_backend import TinyCausalLM
from .vision import vision_of

API = api_snapshot.load("vllm")
MULTIMODAL = api_snapshot.load_multimodal("vllm")
# The emulated replacement: the target is the image's one placeholder token.
assert MULTIMODAL["qwen2_5_vl"]["image_replacement_target"] == "[placeholder[modality]]", MULTIMODAL
__version__ = API["version"]

checked = functools.partial(api_snapshot.checked, API)

_SAMPLING_EPS = 1e-5  # vllm/sampling_params.py
STOP_FIRST = api_snapshot.rule("vllm", "stop_tokens_before_length")["stop_first"]
# processed log-probs of top_k=1 at a temperature > 0: one token kept, so exactly this on every token
TOP_K_1_PROCESSED_LOGPROB = api_snapshot.rule("vllm", "processed_logprobs_of_top_k_1")["logprob"]
# vLLM's fused layers (api/rules.json partial_fused_layer_update): on-disk weight -> the layer it is loaded into.
_PACKED_INTO = {part: fused for fused, parts in api_snapshot.rule("vllm", "partial_fused_layer_update")[
    "packed_modules"].items() for part in parts}


class VLLMValidationError(Exception):  # vllm/exceptions.py: a VLLMClientError, not a ValueError
    pass


@dataclass
class Logprob:  # vllm/logprobs.py
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:  # vllm/outputs.py
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    routed_experts: Optional[np.ndarray] = None  # [seq_len, layer_num, topk]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestOutput:  # vllm/outputs.py (the fields the adapter reads)
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[list]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class SamplingParams:  # vllm/sampling_params.py: the fields, defaults and checks the adapter meets
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: Optional[dict[str, Any]] = None
    routed_experts_prompt_start: int = 0

    def __post_init__(self) -> None:
        lowest = api_snapshot.rule("vllm", "temperature_raised_to_min")["min"]
        if 0 < self.temperature < lowest:
            self.temperature = lowest
        if self.temperature > api_snapshot.rule("vllm", "temperature_above_max")["max"]:
            raise VLLMValidationError(api_snapshot.refusal("vllm", "temperature_above_max",
                                                           temperature=self.temperature))
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        checks = functools.partial(api_snapshot.refusal, "vllm", "sampling_params_checks")
        if self.n < 1:
            raise VLLMValidationError(checks("n", n=self.n))
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(checks("top_p", top_p=self.top_p))
        if self.top_k < -1:
            raise VLLMValidationError(checks("top_k", top_k=self.top_k))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(checks("max_tokens", max_tokens=self.max_tokens))
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(checks("greedy_n", n=self.n))


api_snapshot.check_fields(API, "SamplingParams", SamplingParams.__dataclass_fields__)
api_snapshot.check_fields(API, "CompletionOutput", CompletionOutput.__dataclass_fields__)
api_snapshot.check_fields(API, "Logprob", Logprob.__dataclass_fields__)


class FakeWorker:
    """The parts of vllm/v1/worker/gpu_worker.py's Worker that a worker extension reaches."""

    def __init__(self, model: TinyCausalLM):
        self.rank = 0
        self.local_rank = 0
        self.device = torch.device("cpu")
        self.model_runner = type("GPUModelRunner", (), {})()
        self.model_runner.model = model


class LLM:
    """vllm/entrypoints/llm.py: ``LLM(model, *, ..., **kwargs)`` with the engine arguments as kwargs."""

    @checked("LLM.__init__")
    def __init__(self, model: str, *, tokenizer: Optional[str] = None, skip_tokenizer_init: bool = False,
                 tensor_parallel_size: int = 1, dtype: str = "auto", seed: Optional[int] = None,
                 gpu_memory_utilization: Optional[float] = None, enforce_eager: bool = False,
                 enable_return_routed_experts: bool = False, **kwargs: Any) -> None:
        api_snapshot.check_fields(API, "EngineArgs", kwargs)  # the rest go to EngineArgs
        dp = int(kwargs.get("data_parallel_size", 1))
        if dp > 1 and kwargs.get("distributed_executor_backend") != "external_launcher":
            raise ValueError(api_snapshot.refusal("vllm", "single_process_data_parallel", dp=dp))
        # api/rules.json default_gpu_memory_utilization: what the release takes when none is given (0.34: all of it).
        self.gpu_memory_utilization = gpu_memory_utilization or api_snapshot.rule(
            "vllm", "default_gpu_memory_utilization")[__version__]
        self.max_model_len = kwargs.get("max_model_len") or self._config_length(model)
        if kwargs.get("logprobs_mode", "raw_logprobs") not in API["constants"]["LogprobsMode"]:
            raise ValueError(api_snapshot.refusal("vllm", "logprobs_mode_choices", mode=kwargs["logprobs_mode"],
                                                  modes=API["constants"]["LogprobsMode"]))
        if kwargs.get("weight_transfer_config") is not None:
            api_snapshot.check_fields(API, "WeightTransferConfig", kwargs["weight_transfer_config"])
        if (kwargs.get("weight_transfer_config") or {}).get("backend") == "sharded_rdt":
            # api/rules.json sharded_rdt_needs_ray_executor (unset: "uni" for one worker, "mp" for more).
            world = tensor_parallel_size * kwargs.get("pipeline_parallel_size", 1)
            backend = kwargs.get("distributed_executor_backend") or ("uni" if world == 1 else "mp")
            needed = api_snapshot.rule("vllm", "sharded_rdt_needs_ray_executor")["executor"]
            if isinstance(backend, str) and backend != needed:
                raise ValueError(api_snapshot.refusal("vllm", "sharded_rdt_needs_ray_executor", backend=backend))
        self.calls: list[tuple] = [("__init__", model, dict(
            kwargs, skip_tokenizer_init=skip_tokenizer_init, gpu_memory_utilization=gpu_memory_utilization,
            enable_return_routed_experts=enable_return_routed_experts))]
        self.engine_args = dict(kwargs, skip_tokenizer_init=skip_tokenizer_init,
                                tensor_parallel_size=tensor_parallel_size)
        self.model = TinyCausalLM(model)
        self.llm_engine = FakeLoRA(self.model, kwargs)  # the LLMEngine's LoRA calls
        self.vision = vision_of(model)
        if self.vision is not None and skip_tokenizer_init:  # api/rules.json multimodal_processor_needs_tokenizer
            raise ValueError(api_snapshot.refusal("vllm", "multimodal_processor_needs_tokenizer",
                                                  processor="Qwen2_5_VLMultiModalProcessor"))
        self.mm_requests: list[list[Optional[dict]]] = []
        self.return_routed_experts = enable_return_routed_experts
        if enable_return_routed_experts:  # api/rules.json routed_experts_needs
            needs = functools.partial(api_snapshot.refusal, "vllm", "routed_experts_needs")
            if not self.model.num_experts:
                raise ValueError(needs("moe"))
            if kwargs.get("enable_prefix_caching") is False:
                raise ValueError(needs("prefix_caching"))
            if kwargs.get("pipeline_parallel_size", 1) > 1:
                raise ValueError(needs("pipeline"))
        generation_config = Path(model) / "generation_config.json"
        eos = json.loads(generation_config.read_text()).get("eos_token_id") if generation_config.exists() else None
        self._generation_eos = set([eos] if isinstance(eos, int) else eos or [])
        worker_class = FakeWorker
        if kwargs.get("worker_extension_cls"):  # vllm/worker/worker_base.py: the extension joins the bases
            module, _, name = kwargs["worker_extension_cls"].rpartition(".")
            worker_class = type("Worker", (FakeWorker, getattr(importlib.import_module(module), name)), {})
        self.worker = worker_class(self.model)
        self.busy_resets = 0  # reset_prefix_cache calls that will find requests holding KV blocks
        self._asleep: dict[str, int] = {}  # tag -> sleep level
        self._offloaded: list[torch.Tensor] = []
        self._updating = False
        self.weight_version: Optional[str] = None

    @checked("LLM.generate")
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, **_) -> list[RequestOutput]:
        with self.llm_engine.applied(lora_request):
            return self._generate(prompts, sampling_params)

    def _generate(self, prompts, sampling_params) -> list[RequestOutput]:
        if self._asleep:
            raise RuntimeError("generate called while the engine sleeps")
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], list(sampling_params)))
        processed = [self._process(p) for p in prompts]
        self.mm_requests.append(processed)
        prompts = [p if mm is None else {"prompt_token_ids": mm["prompt_token_ids"]} for p, mm in zip(prompts, processed)]
        # vllm/v1/sample/sampler.py: processed log-probs come after temperature, top-k and top-p.
        logprobs_of = "processed" if self.engine_args.get("logprobs_mode", "raw_logprobs") == "processed_logprobs" else "raw"
        results = []
        for request_id, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            if not 0 <= params.routed_experts_prompt_start <= len(prompt["prompt_token_ids"]):
                raise VLLMValidationError(api_snapshot.refusal(
                    "vllm", "routed_experts_prompt_start_range", length=len(prompt["prompt_token_ids"]),
                    start=params.routed_experts_prompt_start))
            self._check_length(prompt["prompt_token_ids"])
            # The scheduler ends a request at max_model_len tokens ("length"), whatever max_tokens asked for.
            max_tokens = min(params.max_tokens, self.max_model_len - len(prompt["prompt_token_ids"]))
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._generation_eos)
            completions = []
            for index in range(params.n):  # vllm/v1/engine/parallel_sampling.py: child seeds are seed + index
                seed = None if params.seed is None else params.seed + index
                tokens, logprobs, reason = self.model.decode(
                    prompt["prompt_token_ids"], max_tokens=max_tokens, stop_ids=stop_ids,
                    temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed,
                    logprobs_of=logprobs_of, stop_first=STOP_FIRST)
                if logprobs_of == "processed" and params.top_k == 1 and params.temperature > 0:
                    logprobs = [TOP_K_1_PROCESSED_LOGPROB] * len(tokens)
                completions.append(CompletionOutput(
                    index=index, text="", token_ids=tokens, cumulative_logprob=sum(logprobs),
                    logprobs=[{t: Logprob(lp, rank=None)} for t, lp in zip(tokens, logprobs)],
                    routed_experts=self._routed_experts(prompt["prompt_token_ids"], tokens, params),
                    finish_reason=reason, stop_reason=tokens[-1] if reason == "stop" else None))
            results.append(RequestOutput(str(request_id), None, prompt["prompt_token_ids"], None, completions, True))
        return results

    @staticmethod
    def _config_length(model: str) -> int:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config.get("max_position_embeddings", 2048))

    def _check_length(self, prompt_token_ids: list[int]) -> None:
        """``api/rules.json`` prompt_longer_than_max_model_len."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(api_snapshot.refusal("vllm", "prompt_longer_than_max_model_len",
                                                  length=len(prompt_token_ids), max_model_len=self.max_model_len))

    def _process(self, prompt: dict) -> Optional[dict]:
        """A ``TokensPrompt``'s multi-modal data, as vLLM 0.33 turns it into model inputs (see the docstring)."""
        unknown = sorted(set(prompt) - set(MULTIMODAL["tokens_prompt_keys"]))
        if unknown or "prompt_token_ids" not in prompt:
            raise TypeError(f"vllm {__version__} TokensPrompt (vllm/inputs/llm.py) has no key(s) {unknown} "
                            f"or lacks prompt_token_ids: {sorted(prompt)}")
        data = prompt.get("multi_modal_data")
        if not data:
            if prompt.get("mm_processor_kwargs"):
                raise NotImplementedError("the fake emulates mm_processor_kwargs only with multi_modal_data")
            return None
        parse = functools.partial(api_snapshot.refusal, "vllm", "multimodal_data")
        for modality in data:
            if modality not in MULTIMODAL["modalities"]:
                raise ValueError(parse("modality", modality=modality))
        if set(data) != {"image"}:
            raise NotImplementedError(f"the fake emulates images only, got {sorted(data)}")
        if self.vision is None:
            raise ValueError(parse("not_multimodal", model=self.model.model.config.model_type))
        images = data["image"]
        if isinstance(images, dict):  # Qwen2VLMultiModalDataParser._parse_image_data -> DictEmbeddingItems
            required = set(MULTIMODAL["qwen2_5_vl"]["dict_image_fields"])
            if not required <= set(images):
                raise ValueError(parse("fields", required=required, found=set(images)))
            raise NotImplementedError("the fake does not emulate image embeddings")
        import importlib.util

        import transformers
        from PIL import Image
        from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

        images = [images] if isinstance(images, Image.Image) else list(images)
        if not all(isinstance(image, Image.Image) for image in images):
            raise TypeError(f"the fake takes PIL images as vLLM image items, got {[type(i).__name__ for i in images]}")
        kwargs = dict(prompt.get("mm_processor_kwargs") or {})
        unknown = sorted(set(kwargs) - set(MULTIMODAL["qwen2_5_vl"]["size_kwargs"]))
        if unknown:
            raise TypeError(f"the fake emulates only the size kwargs {MULTIMODAL['qwen2_5_vl']['size_kwargs']}, "
                            f"got {unknown}")
        # vllm/transformers_utils/processor.py loads the processor as transformers' Auto classes pick it: the
        # torchvision backend where torchvision is installed, else the PIL one (their pixels differ in the last bits)
        backend = "torchvision" if importlib.util.find_spec("torchvision") else "pil"
        processor_class = getattr(transformers, IMAGE_PROCESSOR_MAPPING_NAMES["qwen2_5_vl"][backend])
        processor = processor_class(patch_size=self.vision.patch, merge_size=self.vision.merge,
                                    temporal_patch_size=self.vision.temporal)
        size = dict(processor.size)  # request kwargs win over the checkpoint's (_complete_mm_processor_size_aliases)
        size.update({edge: kwargs[key] for edge, key in (("shortest_edge", "min_pixels"),
                                                          ("longest_edge", "max_pixels")) if key in kwargs})
        encoded = processor(images=[image.convert("RGB") for image in images], return_tensors="pt",
                            size={"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]})
        ids, expanded, start = list(prompt["prompt_token_ids"]), [], 0
        for grid in encoded["image_grid_thw"]:  # PromptReplacement(target=[pad]) per image, in prompt order
            if self.vision.image_token_id not in ids[start:]:
                raise RuntimeError(f"Expected there to be {len(images)} prompt updates corresponding to "
                                   f"{len(images)} image items, but instead found fewer prompt updates!")
            position = ids.index(self.vision.image_token_id, start)
            expanded += ids[start:position] + [self.vision.image_token_id] * self.vision.tokens(grid)
            start = position + 1
        expanded += ids[start:]
        return {"prompt_token_ids": expanded, "pixel_values": encoded["pixel_values"],
                "image_grid_thw": encoded["image_grid_thw"]}

    def _routed_experts(self, prompt: list[int], tokens: list[int], params: SamplingParams) -> Optional[np.ndarray]:
        """AuxOutputSchedulerConnector.take_output: rows [routed_experts_prompt_start, num_tokens - 1)."""
        if not self.return_routed_experts:
            return None
        form = API["routed_experts"]
        sequence = prompt + tokens
        rows = self.model.routed_experts(sequence[:len(sequence) + form["rows_end_offset"]])
        small = self.model.num_experts <= form["max_experts_small"]
        return rows[params.routed_experts_prompt_start:].astype(form["dtype_small" if small else "dtype_large"])

    def _check_weight_transfer(self) -> None:  # vllm/v1/worker/gpu_worker.py: _check_weight_transfer_engine
        if self.engine_args.get("weight_transfer_config") is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable "
                               "weight transfer.")

    @checked("RLOfflineMixin.start_weight_update")
    def start_weight_update(self) -> None:
        self._check_weight_transfer()
        self.calls.append(("start_weight_update",))
        self._updating = True
        self._loaded_before_update = len(self.model.loaded)

    @checked("RLOfflineMixin.finish_weight_update")
    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._check_weight_transfer()
        self.calls.append(("finish_weight_update", weight_version))
        self._updating = False
        self._rebuild_partly_sent_layers(self.model.loaded[self._loaded_before_update:])
        if weight_version is not None:
            self.weight_version = weight_version

    def _rebuild_partly_sent_layers(self, sent: list[str]) -> None:
        """``api/rules.json`` partial_fused_layer_update: a fused layer that got part of its weights in the session
        is rebuilt from uninitialised memory with only those parts copied in (here: NaN where nothing was sent)."""
        def layer(name: str) -> str:
            *module, part, _parameter = name.split(".")
            if "experts" in module:  # FusedMoE: every expert of a layer is one layer
                return ".".join(module[:module.index("experts") + 1])
            return ".".join([*module, _PACKED_INTO.get(part, part)])

        sent_set = set(sent)
        for fused in {layer(name) for name in sent}:
            members = [name for name in self.model.weight_map.slots if layer(name) == fused]
            if sent_set.issuperset(members):
                continue
            for name in members:
                if name not in sent_set:
                    target = self.model.weight_map.resolve(name)
                    self.model.weight_map.tensors[target.tensor_name].data[target.index].fill_(float("nan"))

    @checked("RLOfflineMixin.init_weight_transfer_engine")
    def init_weight_transfer_engine(self, request) -> None:
        self._check_weight_transfer()
        init_info = request["init_info"] if isinstance(request, dict) else request.init_info
        if self.engine_args["weight_transfer_config"].get("backend") == "sharded_rdt":
            api_snapshot.check_fields(API, "ShardedRDTWeightTransferInitInfo", init_info)
        self.calls.append(("init_weight_transfer_engine", init_info))
        self.transfer_init = init_info
        self.syncs = 0

    @checked("RLOfflineMixin.update_weights")
    def update_weights(self, request) -> None:
        self._check_weight_transfer()
        update_info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.calls.append(("update_weights", update_info))
        if not self._updating:
            raise RuntimeError("update_weights outside start_weight_update / finish_weight_update")
        if self.engine_args["weight_transfer_config"].get("backend") == "sharded_rdt":
            from .fake_vllm_weight_transfer import pull

            api_snapshot.check_fields(API, "ShardedRDTWeightTransferUpdateInfo", update_info)
            self.worker.model_runner.model.load_weights(pull(self.transfer_init, self.syncs))
            self.syncs += 1

    @checked("LLM.collective_rpc")
    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict[str, Any]] = None) -> list:
        self.calls.append(("collective_rpc", method, args))
        if self._asleep.get("weights") and method != "rlmega_init_weight_group":
            raise RuntimeError("CUDA error: an illegal memory access (weights written while asleep)")
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    @checked("LLM.reset_prefix_cache")
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """``api/rules.json`` reset_prefix_cache_in_use: False while requests hold KV blocks (``busy_resets``:
        how many more calls find them; a test sets it), the cache kept."""
        self.calls.append(("reset_prefix_cache",))
        if self.busy_resets and not reset_running_requests:
            self.busy_resets -= 1
            return api_snapshot.rule("vllm", "reset_prefix_cache_in_use")["returns"]
        self.model.prefix_cache.clear()
        self.llm_engine.caches.clear()
        return True

    @checked("LLM.sleep")
    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.engine_args.get("enable_sleep_mode"):
            # vLLM 0.33 refuses nothing here: without sleep mode its allocator holds no tagged memory to free
            raise NotImplementedError("the fake emulates sleep only with enable_sleep_mode=True")
        self.calls.append(("sleep", level))
        self.reset_prefix_cache()
        params = self.model.parameters()
        self._offloaded = [p.data.clone() for p in params] if level == 1 else []
        for p in params:
            p.data.fill_(float("nan"))  # device memory released: its contents are gone
        self._asleep = {"weights": level, "kv_cache": level}

    @checked("LLM.wake_up")
    def wake_up(self, tags: Optional[list[str]] = None):
        self.calls.append(("wake_up", tags))
        tags = tags or ["weights", "kv_cache"]
        if "weights" not in tags and "weights" in self._asleep:
            raise RuntimeError("CUDA error: buffers restored into weights that are still asleep")
        if "weights" in tags and self._asleep.pop("weights", None) == 1:
            for p, saved in zip(self.model.parameters(), self._offloaded):
                p.data.copy_(saved)
        if "kv_cache" in tags:
            self._asleep.pop("kv_cache", None)

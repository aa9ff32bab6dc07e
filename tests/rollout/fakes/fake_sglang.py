"""A stand-in for the ``sglang`` package (0.5.23), installed as ``sys.modules["sglang"]`` by the tests.

Every ``Engine`` call is bound to the signature recorded from the 0.5.23 wheel (``api/sglang.json``, via
``api_snapshot.check_call``), server arguments and sampling-parameter keys are checked against the recorded
fields, and the log-prob switch the fake reads is the one the wheel reads. Behaviour the adapter relies on
is reproduced: sampling-parameter dicts as in sglang/srt/sampling/sampling_params.py (temperature 0 ->
top_k 1, top_k -1 for all, ``sampling_seed`` used only with ``enable_deterministic_inference``, which needs
an attention backend from ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` when one is named);
Req.update_finish_state (stop tokens tested before the length: ``api/rules.json`` stop_tokens_before_length;
``ignore_eos`` disables the EOS ids *and* ``stop_token_ids``, _check_token_based_finish); a request the scheduler
rejects raised from ``generate`` (rejection_raised_by_generate); every refusal's message read from ``api/rules.json``;
the log-probs of sglang/srt/layers/sampler.py (``log_softmax(logits / temperature)`` unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` was set when the engine started); weight updates that run only inside
a ``begin_weight_update`` / ``end_weight_update`` session
(sglang/srt/managers/scheduler_components/weight_updater.py) and return ``(success, message)``; a
distributed update for a group that was never joined fails (``receive_weights_from_distributed`` asserts);
release/resume of the "weights" and "kv_cache" tags, which free nothing without ``enable_memory_saver``
and keep the weights only with ``enable_weights_cpu_backup``. Routed experts, in the format recorded from the
wheel (``API["routed_experts"]``): a request with ``return_routed_experts`` on an engine started with
``enable_return_routed_experts`` gets ``meta_info["routed_experts"]``, base64 of int32
``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]`` (each MoE layer at its
layer id, zeros elsewhere); without the server argument, nothing (no capturer); a request aborted while
queued gets nothing; a bad ``routed_experts_start_len`` aborts the request. Calls are recorded in ``calls``.

Threads and aborts, as in 0.5.23: the ``Engine`` binds the event loop of the thread that builds it
(``Engine._ensure_event_loop``) and every method runs ``self.loop.run_until_complete``; a second thread
entering while a call runs fails ("This event loop is already running"). ``TokenizerManager.abort_request``
runs on that loop. The scheduler (here: decoding in an executor thread, one request after another) aborts
what it holds (Scheduler.abort_request): a queued request comes back without ``output_ids``, a running one
after one more token, with its tokens and log-probs.

Images, as recorded from the wheel (``api/sglang_multimodal.json``): ``image_data`` is normalised as
GenerateReqInput._normalize_image_data does (one list per request when the first entry is a list, else every
entry wrapped in a list), each request's list is validated as BaseMultimodalProcessor.validate_mm_data does (a
pre-processed dict must be the only item), a dict's ``format`` must be a recorded pre-processed format and its
other keys image keys of ``ATTR_NAME_TO_MODALITY``; the fake emulates ``processor_output`` only (raw images and
embeddings raise ``NotImplementedError``). The input ids are kept as given (load_mm_data's fast path for
pre-processed data), each run of the image pad token is one image (get_mm_items_offset), and the bundled
``pixel_values`` are split by ``image_grid_thw`` (get_new_expanded_mm_items): where runs, grids and patches
disagree SGLang silently keeps the bundle (features misplaced), so the fake raises. What the model sees is in
``mm_requests`` (per ``generate`` call, per request: None or its ``offsets``, ``pixel_values``, ``image_grid_thw``).

LoRA (``fake_sglang_lora``): with ``enable_lora`` the engine takes PEFT adapters by ``load_lora_adapter`` and applies
the one each request names in ``generate(..., lora_path=...)`` (``W + scale * B @ A``).
"""

from __future__ import annotations

import functools
import asyncio
import base64
import dataclasses
import itertools
import json
import os
import threading
from pathlib import Path

import torch

from rlmega.rollout.weight_group import init_weight_update_group, receive_weights

from . import api_snapshot
from .fake_sglang_lora import FakeSGLangLoRA
from .tiny_backend import TinyCausalLM
from .vision import pad_runs, vision_of

API = api_snapshot.load("sglang")
MULTIMODAL = api_snapshot.load_multimodal("sglang")
__version__ = API["version"]
RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"  # sglang/srt/layers/sampler.py, read at import
api_snapshot.check_env(API, RAW_LOGPROB_ENV)

checked = functools.partial(api_snapshot.checked, API)
STOP_FIRST = api_snapshot.rule("sglang", "stop_tokens_before_length")["stop_first"]


@dataclasses.dataclass(kw_only=True)
class FlushCacheReqOutput:  # sglang/srt/managers/io_struct.py:1859-1861
    success: bool
    message: str = ""


def _eos_ids(model_path: str) -> set[int]:
    """ModelConfig.hf_eos_token_id: config.json's eos_token_id and generation_config.json's."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(model_path) / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        ids.update([value] if isinstance(value, int) else value or [])
    return ids


class TokenizerManager:
    """What the adapter reaches of sglang/srt/managers/tokenizer_manager.py's TokenizerManager."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.event_loop = loop
        self.rid_to_state: dict[str, threading.Event] = {}  # requests the scheduler holds -> their to_abort
        self.aborts = 0  # AbortReq messages sent

    @checked("TokenizerManager.abort_request")
    def abort_request(self, rid: str = "", abort_all: bool = False):
        if asyncio.get_running_loop() is not self.event_loop:  # RuntimeError outside any loop
            raise RuntimeError("abort_request sends on the handle loop's zmq socket: call it on that loop")
        self.aborts += 1
        for request_id, to_abort in self.rid_to_state.items():
            if abort_all or request_id.startswith(rid):
                to_abort.set()


def _ensure_event_loop() -> asyncio.AbstractEventLoop:  # Engine._ensure_event_loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


class Engine:
    def __init__(self, **kwargs):
        api_snapshot.check_fields(API, "ServerArgs", kwargs)
        backend = kwargs.get("attention_backend")
        choices = API["constants"]["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"]
        if kwargs.get("enable_deterministic_inference") and backend is not None and backend not in choices:
            raise ValueError(api_snapshot.refusal("sglang", "deterministic_attention_backend", choices=choices,
                                                  backend=backend))
        self.server_args = kwargs
        self.loop = _ensure_event_loop()
        self.tokenizer_manager = TokenizerManager(self.loop)
        self._rids = itertools.count()
        self.calls: list[tuple] = [("__init__", dict(kwargs))]
        self.model = TinyCausalLM(kwargs["model_path"])
        self.lora = FakeSGLangLoRA(self.model, kwargs)
        self.vision = vision_of(kwargs["model_path"])
        self.mm_requests: list[list] = []
        self._eos = _eos_ids(kwargs["model_path"])
        # Read by the scheduler processes when they import sglang/srt/layers/sampler.py.
        self._raw_logprobs = os.environ.get(RAW_LOGPROB_ENV, "false").lower() in ("1", "true")
        self._released: set[str] = set()
        self._backup: list[torch.Tensor] = []
        self._groups: dict = {}
        self._session = False  # a begin_weight_update / end_weight_update session is open
        self.busy_flushes = 0  # flush_cache calls that will find requests in the scheduler

    def _single_replica(self, what: str) -> None:
        """``api/rules.json`` data_parallel_weight_update: the update entry points assert dp_size == 1 (the engine
        starts with more, and fails at the first weight update)."""
        if self.server_args.get("dp_size", 1) > 1:
            raise AssertionError(api_snapshot.refusal("sglang", "data_parallel_weight_update", what=what))

    def _run(self, coroutine):
        return self.loop.run_until_complete(coroutine)  # fails if another thread is running the loop

    async def _now(self, value):
        return value

    @checked("Engine.generate")
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, return_logprob=False,
                 logprob_start_len=None, lora_path=None, return_routed_experts=False, routed_experts_start_len=0,
                 **_):
        if self._released:
            raise RuntimeError("generate called while memory is released")
        adapters = self.lora.per_request(lora_path, len(input_ids))
        self.mm_requests.append(self._images(input_ids, image_data))
        for params in sampling_params:
            api_snapshot.check_fields(API, "SamplingParams", params)
        self.calls.append(("generate", input_ids, sampling_params, return_logprob, logprob_start_len,
                           return_routed_experts))
        # RoutedExpertsCapturer.create: no capturer unless the server argument is set.
        routing_start = routed_experts_start_len if (
            return_routed_experts and self.server_args.get("enable_return_routed_experts")) else None
        return self._run(self._in_scheduler(self.loop, input_ids, sampling_params, return_logprob, routing_start,
                                            adapters))

    def _images(self, input_ids, image_data) -> list:
        """Per request None or what its images become (see the docstring)."""
        if image_data is None:
            return [None] * len(input_ids)
        if not isinstance(image_data, list) or len(image_data) != len(input_ids):
            raise ValueError(api_snapshot.refusal("sglang", "image_data_batch"))
        if not isinstance(image_data[0], list):  # _normalize_image_data: a list of images, one per request
            image_data = [[item] for item in image_data]
        return [self._request_images(ids, items) for ids, items in zip(input_ids, image_data)]

    def _request_images(self, ids: list[int], items):
        if items is None or items == [None] or not items:  # has_valid_data: nothing to process
            return None
        if not isinstance(items, list):
            raise TypeError(f"IMAGE must be a list or None, got {type(items)}")
        dicts = [item for item in items if isinstance(item, dict) and item.get("format") is not None]
        if dicts and len(items) != 1:
            raise ValueError(api_snapshot.refusal("sglang", "processor_output_single_item", modality="Modality.IMAGE",
                                                  count=len(items), indices=[items.index(item) for item in dicts]))
        if not dicts:
            if any(isinstance(item, (list, dict)) for item in items):
                raise RuntimeError(f"Error while loading data {items!r:.100}")  # load_image on a list / plain dict
            raise NotImplementedError("the fake emulates pre-processed images only")
        (item,) = dicts
        if item["format"] not in MULTIMODAL["format_strings"]:
            raise NotImplementedError(f"not a pre-processed format: {item['format']!r} "
                                      f"({MULTIMODAL['format_strings']})")  # a plain dict: load_image fails
        if item["format"] != "processor_output":
            raise NotImplementedError("the fake emulates processor_output only")
        unknown = sorted(set(item) - {"format"} - set(MULTIMODAL["image_keys"]))
        if unknown:
            raise TypeError(f"sglang {__version__} reads no image key(s) {unknown} from a processor output")
        if self.vision is None:
            raise NotImplementedError("the fake emulates images only for a model with a vision tower")
        pixels, grid = item.get("pixel_values"), item.get("image_grid_thw")
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor) or grid.ndim != 2:
            raise TypeError("a Qwen-VL processor output needs tensors pixel_values [patches, dim] and "
                            "image_grid_thw [images, 3]")
        runs = pad_runs(ids, self.vision.image_token_id)
        sizes = grid.prod(-1).tolist()
        if len(runs) != len(grid) or sum(sizes) != len(pixels) or \
                [length for _, length in runs] != [self.vision.tokens(g) for g in grid]:
            raise RuntimeError(f"pad runs {runs} disagree with image_grid_thw {grid.tolist()} and "
                               f"{len(pixels)} patches: SGLang would misplace the image features")
        return {"offsets": [(start, start + length - 1) for start, length in runs],
                "pixel_values": list(pixels.split(sizes)), "image_grid_thw": grid}

    async def _in_scheduler(self, loop, input_ids, sampling_params, return_logprob, routing_start, adapters):
        requests = [(str(next(self._rids)), ids, params, threading.Event())
                    for ids, params in zip(input_ids, sampling_params)]
        self.tokenizer_manager.rid_to_state.update({rid: to_abort for rid, _, _, to_abort in requests})
        try:
            return await loop.run_in_executor(None, self._decode, requests, return_logprob, routing_start, adapters)
        finally:
            for rid, _, _, _ in requests:
                del self.tokenizer_manager.rid_to_state[rid]

    def _routed_experts(self, ids: list[int], tokens: list[int], start: int) -> str:
        """_maybe_collect_routed_experts -> BaseTopkCapturer.get_topk (rows [start, seqlen - 1)), sent
        base64-encoded (TokenizerManager, skip_tokenizer_init)."""
        form = API["routed_experts"]
        sequence = ids + tokens
        rows = self.model.routed_experts(sequence[:len(sequence) + form["rows_end_offset"]])[start:]
        return base64.b64encode(rows.astype(form["dtype"]).tobytes()).decode("utf-8")

    def _decode(self, requests, return_logprob, routing_start=None, adapters=None):
        outputs = []
        for (rid, ids, params, to_abort), adapter in zip(requests, adapters or [None] * len(requests)):
            with self.lora.applied(adapter):
                outputs.extend(self._decode_one(rid, ids, params, to_abort, return_logprob, routing_start))
        return outputs

    def _decode_one(self, rid, ids, params, to_abort, return_logprob, routing_start):
        if routing_start is not None and not 0 <= routing_start <= len(ids):
            # api/rules.json rejection_raised_by_generate: the scheduler rejects it (status 400), and a
            # non-streaming generate raises the message for the whole batch.
            assert api_snapshot.rule("sglang", "rejection_raised_by_generate")["raises_for_status"] == 400
            raise ValueError(api_snapshot.refusal(  # status 400: a ValueError; others an HTTPException
                "sglang", "rejection_raised_by_generate", "above_prompt" if routing_start > 0 else "below_zero",
                start=routing_start, length=len(ids)))
        if to_abort.is_set():  # still queued: popped from the waiting queue (tokenizer_manager.py:3577-3600)
            return [{"text": "", "meta_info": {
                "id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "prompt_tokens": 0, "completion_tokens": 0}}]
        outputs = []
        temperature, top_k = params.get("temperature", 1.0), params.get("top_k", -1)
        if 0 <= temperature < 1e-6:
            temperature, top_k = 1.0, 1
        seed = params.get("sampling_seed", 42) if self.server_args.get("enable_deterministic_inference") else None
        stop_ids = set() if params.get("ignore_eos") else set(params.get("stop_token_ids") or []) | self._eos
        for _ in range(params.get("n", 1)):  # parallel samples share the seed
            tokens, logprobs, reason = self.model.decode(
                ids, max_tokens=params.get("max_new_tokens", 128), stop_ids=stop_ids, temperature=temperature,
                top_k=top_k, top_p=params.get("top_p", 1.0), seed=seed,
                logprobs_of="raw" if self._raw_logprobs else "scaled", aborted=to_abort.is_set,
                stop_first=STOP_FIRST)
            finish = {"stop": {"type": "stop", "matched": tokens[-1]},
                      "length": {"type": "length", "length": params.get("max_new_tokens", 128)},
                      "abort": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                      }[reason]
            meta = {"id": str(rid), "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": len(tokens), "cached_tokens": 0}
            if return_logprob:
                meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, tokens)]
            if routing_start is not None:
                meta["routed_experts"] = self._routed_experts(ids, tokens, routing_start)
            outputs.append({"output_ids": tokens, "meta_info": meta})
        return outputs

    @checked("Engine.begin_weight_update")
    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update",))
        if self._session:
            return self._run(self._now((False, "a weight-update session is already open; "
                                               "call end_weight_update() first")))
        self._session = True
        return self._run(self._now((True, "Success")))

    @checked("Engine.end_weight_update")
    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        if not self._session:
            return self._run(self._now((False, "no weight-update session is open; "
                                               "call begin_weight_update() first")))
        self._session = False
        return self._run(self._now((True, "Success")))

    def _outside_session(self, what: str):
        return False, f"{what} must run between begin_weight_update() and end_weight_update()"

    @checked("Engine.update_weights_from_tensor")
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._single_replica("update weights from tensor")
        self.calls.append(("update_weights_from_tensor", [name for name, _ in named_tensors], load_format,
                           flush_cache))
        if not self._session:
            return self._run(self._now(self._outside_session("update_weights_from_tensor")))
        if "weights" in self._released:
            raise RuntimeError("scheduler died: weights written while their memory is released")
        self.model.load_weights(named_tensors)
        return self._run(self._now((True, "Success")))

    @checked("Engine.init_weights_update_group")
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self._single_replica("update weights from distributed")
        self.calls.append(("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                           group_name, backend))
        self._groups[group_name] = init_weight_update_group(master_address, master_port, rank_offset + 0, world_size,
                                                            group_name, backend)
        return self._run(self._now((True, "Succeeded to initialize custom process group.")))

    @checked("Engine.destroy_weights_update_group")
    def destroy_weights_update_group(self, group_name):
        self._single_replica("destroy parameter update group")
        self.calls.append(("destroy_weights_update_group", group_name))
        if group_name not in self._groups:
            return self._run(self._now((False, "The group to be destroyed does not exist.")))
        torch.distributed.destroy_process_group(self._groups.pop(group_name))
        return self._run(self._now((True, "Succeeded to destroy custom process group.")))

    @checked("Engine.update_weights_from_distributed")
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self._single_replica("update weights from distributed")
        self.calls.append(("update_weights_from_distributed", names, dtypes, shapes, group_name, flush_cache))
        if not self._session:
            return self._run(self._now(self._outside_session("update_weights_from_distributed")))
        if group_name not in self._groups:  # model_runner_components/weight_updater.py asserts
            return self._run(self._now((False, f"Failed to receive weights: Group {group_name} not in "
                                               f"{list(self._groups)}. Please call `init_weights_update_group` first.")))
        if "weights" in self._released:
            raise RuntimeError("scheduler died: weights written while their memory is released")
        self.model.load_weights(receive_weights(self._groups[group_name], list(zip(names, dtypes, shapes)), "cpu"))
        return self._run(self._now((True, "Succeeded to update parameter online.")))

    @checked("Engine.load_lora_adapter")
    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.calls.append(("load_lora_adapter", lora_name, lora_path, pinned))
        return self._run(self._now(self.lora.load(lora_name, lora_path)))

    @checked("Engine.unload_lora_adapter")
    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload_lora_adapter", lora_name))
        return self._run(self._now(self.lora.unload(lora_name)))

    @checked("Engine.flush_cache")
    def flush_cache(self):
        """``api/rules.json`` flush_cache_while_busy: refused (success False, the cache kept) while requests are
        queued or running (``busy_flushes``: how many more calls find them; a test sets it)."""
        self.calls.append(("flush_cache",))
        if self.busy_flushes:
            self.busy_flushes -= 1
            message = api_snapshot.refusal("sglang", "flush_cache_while_busy", queued=0, running=1)
            return self._run(self._now(FlushCacheReqOutput(success=False, message=message)))
        self.model.prefix_cache.clear()
        self.lora.caches.clear()  # one radix tree, its keys carrying the adapter
        return self._run(self._now(FlushCacheReqOutput(success=True)))

    @checked("Engine.release_memory_occupation")
    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))
        tags = tags or ["weights", "kv_cache"]
        if not self.server_args.get("enable_memory_saver"):
            return  # the memory saver adapter is a no-op
        if "weights" in tags:
            params = self.model.parameters()
            self._backup = [p.data.clone() for p in params] if self.server_args.get("enable_weights_cpu_backup") else []
            for p in params:
                p.data.fill_(float("nan"))
        if "kv_cache" in tags:
            self.model.prefix_cache.clear()
            self.lora.caches.clear()
        self._released.update(tags)
        self._run(self._now(None))

    @checked("Engine.resume_memory_occupation")
    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and "weights" in self._released:
            for p, saved in zip(self.model.parameters(), self._backup):
                p.data.copy_(saved)
        self._released.difference_update(tags)
        self._run(self._now(None))

    @checked("Engine.shutdown")
    def shutdown(self):
        self.calls.append(("shutdown",))

"""``RolloutEngine`` over SGLang's offline ``sglang.Engine`` (SGLang >=0.5.23,<0.5.24).

Two ways to get new weights in:

- colocated: ``update_weights(named_tensors, version)`` sends checked buckets with
  ``Engine.update_weights_from_tensor`` (which serialises them for the scheduler processes: CUDA IPC
  handles for GPU tensors, per TP rank) inside one ``begin_weight_update`` / ``end_weight_update``
  session, and flushes the radix cache once, at the commit.
- disaggregated: ``init_weight_update_group(...)`` (SGLang's ``init_weights_update_group``), then
  ``begin_update`` / ``receive_weights(metas)`` / ``commit_update`` while the trainer rank broadcasts each
  bucket with ``rlmega.rollout.weight_group.broadcast_weights``.

``record_routing=True`` starts the engine with ``enable_return_routed_experts`` and asks every request for its
routed experts (MoE routing replay, R3): each ``Generation`` then carries ``routing``.

``pause_generation`` aborts the requests of a running ``generate`` in SGLang's scheduler
(``TokenizerManager.abort_request(abort_all=True)``); they come back with the tokens generated so far.

``lora_rank > 0`` (``sync.lora=adapters``) starts the engine with SGLang's LoRA: updates then carry the trained
adapter (and base weights only when the base changed), which SGLang loads by name from a PEFT directory at the commit
and every request names (``rlmega.rollout.lora_serving``).

Every call into SGLang is in the "SGLang 0.5.23 API" section below; README.md says what was checked where;
tests/rollout/fakes/api/sglang.json is what the wheel's source says of each call.
"""

from __future__ import annotations

import base64
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rlmega.rollout.engine_common import (
    DEFAULT_BUCKET_BYTES,
    EngineAdapter,
    EngineResponse,
    adapter_settings,
    check_version,
)
from rlmega.rollout.lora_serving import ServedAdapter
from rlmega.rollout.protocol import SamplingParams
from rlmega.rollout.weight_group import WeightMeta
from rlmega.data.schema import ImageInputs

# setup.py's `sglang` extra: sglang>=0.5.23,<0.5.24. SGLang changes its Python API within 0.5.x (0.5.23
# added the weight-update session and renamed the log-prob switch), so the range is one patch release.
SUPPORTED_VERSIONS = ((0, 5, 23), (0, 5, 24))


# ---------------------------------------------------------------------------------------------- SGLang 0.5.23 API
# Checked against the sglang 0.5.23 wheel: sglang/srt/entrypoints/engine.py (Engine: generate,
# update_weights_from_tensor, begin_weight_update, end_weight_update, init_weights_update_group,
# update_weights_from_distributed, destroy_weights_update_group, flush_cache, release_memory_occupation,
# resume_memory_occupation, shutdown, _ensure_event_loop), sglang/srt/sampling/sampling_params.py,
# sglang/srt/layers/sampler.py and sglang/srt/environ.py (which log-probs are returned),
# sglang/srt/managers/scheduler_components/weight_updater.py (the update session),
# sglang/srt/managers/tokenizer_manager.py (abort_request), sglang/srt/arg_groups/ (server arguments).
# Routed experts: sglang/srt/arg_groups/fields/exec_.py (enable_return_routed_experts), Engine.generate's
# return_routed_experts, sglang/srt/state_capturer/routed_experts.py and base.py (a host buffer per KV slot,
# int32 [num_hidden_layers, num_experts_per_tok], each MoE layer at its layer id, logical ids before EPLB;
# get_topk: rows [start, seqlen - 1), the last sampled token never fed),
# sglang/srt/managers/scheduler_components/batch_result_processor.py (_maybe_collect_routed_experts: finished
# requests, seqlen = prompt + output_ids_through_stop), sglang/srt/managers/tokenizer_manager.py
# (meta_info["routed_experts"]: the int32 bytes, base64; extract_routed_experts_from_meta_info decodes it).
# Images (tests/rollout/fakes/api/sglang_multimodal.json): Engine.generate's image_data (one list per request),
# sglang/srt/managers/io_struct.py (GenerateReqInput._normalize_image_data: a list of lists only when the first
# entry is a list, so a text-only request is [], not None), sglang/srt/multimodal/processors/base_processor.py
# (a dict with format "processor_output" holds a HF processor's output, pixel_values + image_grid_thw for all the
# request's images, and must be the request's only item; load_mm_data keeps the input_ids of pre-processed data
# as given, and each run of image pad tokens is one image's features, split by image_grid_thw:
# process_and_combine_mm_data_async, sglang/srt/managers/mm_utils.py get_new_expanded_mm_items),
# sglang/srt/multimodal/processors/qwen_vl.py (Qwen2.5-VL: mrope positions from those runs and grids).
# LoRA: sglang/srt/arg_groups/fields/lora.py (enable_lora, max_lora_rank, lora_target_modules, max_loras_per_batch),
# sglang/srt/arg_groups/lora_hook.py (without lora_paths at start, both max_lora_rank and lora_target_modules are
# required), Engine.load_lora_adapter / unload_lora_adapter (results: LoRAUpdateOutput, success and error_message,
# sglang/srt/managers/io_struct.py; sglang/srt/managers/tokenizer_control_mixin.py refuses a name it has loaded),
# sglang/srt/lora/lora_config.py and lora.py (adapter_config.json's r and lora_alpha, scale lora_alpha / r),
# sglang/srt/lora/mem_pool.py (can_support: a rank above max_lora_rank, or a module outside lora_target_modules
# (q/k/v -> qkv_proj, gate/up -> gate_up_proj: sglang/srt/lora/utils.py get_normalized_target_modules), refused),
# Engine.generate's lora_path (one adapter name per request: GenerateReqInput._normalize_lora_paths, resolved by
# name in TokenizerManager._resolve_lora_path). A LoRA-wrapped layer keeps its base weight under the layer's own name
# (sglang/srt/lora/layers.py BaseLayerWithLoRA: self.weight = base_layer.weight), so base updates load as before.

# sglang/srt/layers/sampler.py reads it when the scheduler processes import it: with it, the returned
# log-probs are log(softmax(raw logits)); without it, log(softmax(logits / temperature)) (greedy requests:
# the raw logits'), which is what the trainer scores. (0.5.3 called it RETURN_ORIGINAL_LOGPROB.)
RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


ABORT_REPEAT_S = 0.05  # while paused, the abort is repeated this often (see _abort_while_paused)


class _EngineThread:
    """The one thread that every call into the ``Engine`` runs on.

    The ``Engine`` binds the event loop of the thread that builds it (``Engine._ensure_event_loop``) and
    each method runs ``self.loop.run_until_complete(...)``: two threads inside at once fail ("This event
    loop is already running"), and a threaded Ray actor calls from a pool of threads. So the calls are
    handed to this thread, one at a time. The ``Engine`` itself is built by the caller: it installs signal
    handlers, which only the main thread may do.
    """

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")

    def run(self, function, *args):
        return self._thread.submit(function, *args).result()

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def _import_sglang():
    import sglang

    check_version("sglang", sglang.__version__, *SUPPORTED_VERSIONS)
    return sglang


# The PEFT modules rlmega's adapters name (rlmega.workers.lora_export: attention and the dense MLP), all in
# sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _engine_settings(record_routing: bool, lora_rank: int = 0, lora_modules: tuple[str, ...] = ()) -> dict:
    """Server arguments the adapter depends on."""
    # The adapter served (base-only requests before the first one): two per batch cover a batch of either.
    lora = {"enable_lora": True, "max_lora_rank": lora_rank, "lora_target_modules": list(lora_modules),
            "max_loras_per_batch": 2} if lora_rank else {}
    return {
        "skip_tokenizer_init": True,  # token ids in and out
        "enable_memory_saver": True,  # without it release_memory_occupation frees nothing
        # The routed-experts capturer exists only with it; requests then ask with return_routed_experts.
        **({"enable_return_routed_experts": True} if record_routing else {}),
        **lora,
    }


def _new_engine(sglang, model: str, server_kwargs: dict):
    if os.environ.get(RAW_LOGPROB_ENV, "0").lower() in ("1", "true"):
        warnings.warn(f"{RAW_LOGPROB_ENV}={os.environ[RAW_LOGPROB_ENV]!r} overridden: the adapter needs the "
                      f"log-probs of the temperature-scaled logits, which the trainer scores the batch under")
    os.environ.pop(RAW_LOGPROB_ENV, None)  # the scheduler processes the engine spawns inherit its absence
    return sglang.Engine(model_path=model, **server_kwargs)


def _sampling_params(params: SamplingParams, seed: int | None, ignore_eos: bool) -> dict:
    sampling = {
        "n": 1,
        "temperature": params.temperature,  # 0 becomes top_k=1 inside SGLang
        "top_p": params.top_p,
        "top_k": params.top_k or -1,  # -1 disables
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        # ignore_eos also disables stop_token_ids (Req.check_finished): see
        # SGLangEngine._engine_generate.
        "ignore_eos": ignore_eos,
        "no_stop_trim": True,  # keep the stop token
    }
    if seed is not None:
        sampling["sampling_seed"] = seed % 2**31  # an int32 tensor inside SGLang
    return sampling


def _routed_experts(meta: dict, num_layers: int, experts_per_token: int) -> np.ndarray | None:
    """``meta_info["routed_experts"]``: base64 of int32 ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]``
    (absent for a request aborted while queued)."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        return None
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return flat.reshape(-1, num_layers, experts_per_token)


def _image_data(images: list[ImageInputs | None] | None) -> dict:
    """``image_data`` of a batch: per request its images as one processor output (the trainer's own pixel values
    and grids, so the vision tower sees what the trainer's does), ``[]`` for a text-only request; nothing when no
    request has images."""
    if images is None:
        return {}
    return {"image_data": [[] if item is None else [{"format": "processor_output", "pixel_values": item.pixel_values,
                                                      "image_grid_thw": item.grid_thw}] for item in images]}


def _abort_failure(meta: dict, paused: bool) -> str | None:
    """Why an "abort" is a failure of the request, not the pause's doing (None: the pause's). The pause's abort
    (``abort_request(abort_all=True)``) finishes a running request with ``FINISH_ABORT()`` ("Aborted", no status
    code: sglang/srt/managers/scheduler.py, ``Scheduler.abort_request``) and a queued one with "Abort in waiting
    queue" (``TokenizerManager._handle_abort_req``). A request the scheduler rejects or gives up on carries an HTTP
    status code (``Req.set_finish_with_abort``: 400, schedule_batch.py; 500 / 503 when memory runs out), which
    non-streaming 0.5.23 raises from ``generate`` instead (tokenizer_manager.py, ``_handle_abort_finish_reason``);
    any abort that comes back while no pause was asked is a failure too."""
    reason = meta["finish_reason"]
    if reason.get("status_code") is None and paused:
        return None
    return f"SGLang aborted request {meta.get('id')}: {reason.get('message') or 'no message'}" + (
        f" (status {reason['status_code']})" if reason.get("status_code") is not None else " (not by a pause)")


def _generate(engine, prompts: list[list[int]], sampling: list[dict],
              routing_shape: tuple[int, int] | None = None,
              images: list[ImageInputs | None] | None = None,
              paused: Callable[[], bool] = lambda: True, adapter: str | None = None) -> list[EngineResponse]:
    """``routing_shape``: ``(num_hidden_layers, num_experts_per_tok)`` to ask for routed experts, else None.
    ``images``: per request, None or its images; the input ids keep their expanded pad tokens. ``paused()``:
    whether a pause was asked during the call (an abort is then the pause's, unless it carries a status code).
    ``adapter``: the name of the LoRA adapter every request applies (None: the base model)."""
    routing = {"return_routed_experts": True} if routing_shape is not None else {}
    lora = {"lora_path": [adapter] * len(prompts)} if adapter is not None else {}
    outputs = engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True,  # -1: no prompt
                              logprob_start_len=-1, **routing, **lora, **_image_data(images))  # log-probs
    responses = []
    for output in outputs:
        meta = output["meta_info"]
        reason = meta["finish_reason"]["type"]
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"SGLang ended request {meta.get('id')} with {meta['finish_reason']}")
        failure = _abort_failure(meta, paused()) if reason == "abort" else None
        if failure is not None:
            raise RuntimeError(failure)
        # An aborted request that was still queued comes back without output_ids (_handle_abort_req).
        tokens = list(output.get("output_ids", []))
        # (logprob, token id, text or None) per generated token
        logprobs = [logprob for logprob, _, _ in meta.get("output_token_logprobs", [])]
        experts = _routed_experts(meta, *routing_shape) if routing_shape is not None else None
        responses.append(EngineResponse(tokens, logprobs, reason == "abort", experts))
    return responses


def _abort_while_paused(engine, paused: threading.Event) -> None:
    """On the engine's loop: abort every request in the scheduler, and again every ``ABORT_REPEAT_S`` while
    paused. The scheduler aborts what it holds (``Scheduler.abort_request``): queued requests come back
    empty, running ones after one more decoding step, with their tokens. A request sent after an abort (a
    call that passed the pause check just before the pause) is caught by the next one. Once resumed the
    repeats stop; while no call runs the loop they wait, and the first call after resume ends them."""
    if paused.is_set():
        engine.tokenizer_manager.abort_request(abort_all=True)
        engine.loop.call_later(ABORT_REPEAT_S, _abort_while_paused, engine, paused)


def _interrupt(engine, paused: threading.Event) -> None:
    """From any thread: the abort runs on the engine's loop, which the running call drives."""
    engine.loop.call_soon_threadsafe(_abort_while_paused, engine, paused)


def _checked(result, what: str) -> None:
    """The update calls return ``(success, message)`` instead of raising."""
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _begin_update(engine) -> None:
    _checked(engine.begin_weight_update(), "begin_weight_update")


def _end_update(engine) -> None:
    _checked(engine.end_weight_update(), "end_weight_update")


def _update_from_tensor(engine, bucket: list[tuple[str, torch.Tensor]]) -> None:
    _checked(engine.update_weights_from_tensor(bucket, load_format=None, flush_cache=False),
             "update_weights_from_tensor")


def _init_group(engine, master_address: str, master_port: int, rank_offset: int, world_size: int,
                group_name: str, backend: str) -> None:
    _checked(engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend=backend), "init_weights_update_group")


def _destroy_group(engine, group_name: str) -> None:
    _checked(engine.destroy_weights_update_group(group_name), "destroy_weights_update_group")


def _update_from_distributed(engine, metas: list[WeightMeta], group_name: str) -> None:
    names, dtypes, shapes = zip(*metas)
    _checked(engine.update_weights_from_distributed(list(names), list(dtypes), [list(s) for s in shapes],
                                                    group_name=group_name, flush_cache=False),
             "update_weights_from_distributed")


def _lora_result(result, what: str) -> None:
    """The LoRA calls return a ``LoRAUpdateOutput`` instead of raising."""
    if not result.success:
        raise RuntimeError(f"SGLang {what} failed: {result.error_message}")


def _load_lora(engine, name: str, path: str) -> None:
    _lora_result(engine.load_lora_adapter(name, path), f"load_lora_adapter of {path}")


def _unload_lora(engine, name: str) -> None:
    _lora_result(engine.unload_lora_adapter(name), f"unload_lora_adapter of {name}")


def _flush_cache(engine) -> bool:
    # The radix cache holds KV computed with the old weights. The scheduler refuses while requests are queued or
    # running (sglang/srt/managers/scheduler.py, Scheduler.flush_cache) and says so only in the result.
    return bool(engine.flush_cache().success)


def _release(engine, tags: list[str]) -> None:
    engine.release_memory_occupation(tags=tags)


def _resume(engine, tags: list[str]) -> None:
    engine.resume_memory_occupation(tags=tags)

# ---------------------------------------------------------------------------------------------- end of SGLang API


class SGLangEngine(EngineAdapter):
    """Implements ``RolloutEngine`` on ``sglang.Engine`` (the shared logic is ``EngineAdapter``'s).

    ``model`` is a local Hugging Face checkpoint directory (safetensors): its headers give the weight
    names and shapes that ``update_weights`` checks before anything reaches SGLang (whose loader fails
    inside the scheduler process). ``server_kwargs`` go to ``sglang.Engine`` (``tp_size``,
    ``mem_fraction_static``, ``dtype``, ...). Two of them matter to the protocol:
    ``enable_weights_cpu_backup=True`` is required for ``sleep(level=1)``, and seeded sampling is
    reproducible only with ``enable_deterministic_inference=True`` (SGLang ignores per-request seeds
    otherwise). Every engine call runs on one thread (``_EngineThread``), so the adapter may be called from
    any thread. ``record_routing=True`` (a MoE checkpoint only: a dense one raises ``ValueError`` here) makes
    every ``Generation`` carry ``routing``, ``[P + R, M, k]`` int16. ``weight_dtype="fp8"``: the engine serves
    blockwise FP8 from an FP8 copy of the checkpoint (``EngineAdapter``); updates are quantized on the way in.
    ``lora_rank > 0``: SGLang's LoRA is enabled for adapters of up to that rank on the checkpoint's attention and
    MLP projections; an update's adapter tensors (PEFT names, ``rlmega.rollout.lora_serving``) are written as a PEFT
    directory under ``lora_dir`` (default: a directory of its own in /dev/shm) and loaded by name at the commit,
    replacing the one before; every request then names it.
    """

    engine_name = "sglang"

    def __init__(self, model: str | os.PathLike, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 record_routing: bool = False, weight_dtype: str = "auto", lora_rank: int = 0,
                 lora_dir: str | None = None, **server_kwargs):
        self._sglang = _import_sglang()
        if lora_rank < 0:
            raise ValueError(f"SGLangEngine lora_rank={lora_rank}: give the adapters' rank (>= 1), or 0 for none")
        if lora_rank and weight_dtype != "auto":
            raise ValueError(f"SGLangEngine lora_rank={lora_rank} serves adapters onto base weights of the "
                             f"checkpoint's dtype: weight_dtype={weight_dtype!r} must be 'auto'")
        super().__init__(model, bucket_bytes=bucket_bytes, engine_version=self._sglang.__version__,
                         record_routing=record_routing, weight_dtype=weight_dtype)
        modules = tuple(module for module in LORA_MODULES
                        if any(name.endswith(f".{module}.weight") for name in self.weights.shapes))
        server_kwargs = adapter_settings("SGLangEngine", server_kwargs,
                                         _engine_settings(record_routing, lora_rank, modules))
        if lora_rank:
            self._adapters = ServedAdapter(self._load_adapter, self._unload_adapter, lora_dir)
        self.keeps_weights_asleep = bool(server_kwargs.get("enable_weights_cpu_backup", False))
        self.engine = _new_engine(self._sglang, str(self.model_path), server_kwargs)
        self._loop = _EngineThread()
        self._pauses = 0  # pause_generation calls: an abort is the pause's only if one came during the call

    def sleep(self, level: int = 1) -> None:
        """Level 1 needs the engine built with ``enable_weights_cpu_backup=True`` (the weights come back on
        wake); level 2 requires a full re-sync whatever the backup."""
        if level == 1 and not self.keeps_weights_asleep and self._book.sleep_level < 2:
            raise ValueError("sleep(level=1) keeps the weights, which SGLang does only when the engine is built "
                             "with enable_weights_cpu_backup=True; use sleep(level=2) and re-sync instead")
        super().sleep(level)

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes."""
        self.engine.shutdown()
        self._loop.close()

    # ------------------------------------------------------------------ engine calls: the SGLang 0.5.23 API above

    def _engine_generate(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None],
                         images: list[ImageInputs | None] | None = None) -> list[EngineResponse]:
        """SGLang always stops at the checkpoint's EOS ids unless ``ignore_eos``, which also disables
        ``stop_token_ids``. A request whose stop ids cover every EOS id runs as is; any other runs with
        ``ignore_eos`` to ``max_new_tokens`` and is cut after its first stop token by ``finish_response``:
        exact, but it decodes past the stop.
        """
        sampling = [_sampling_params(p, seed, ignore_eos=not self.facts.eos_token_ids <= set(p.stop_token_ids))
                    for p, seed in zip(params, seeds)]
        routing_shape = (self.facts.num_layers, self.facts.experts_per_token) if self.record_routing else None
        # A pause in effect as the call starts, or asked during it, aborts it (_abort_while_paused repeats).
        pauses, paused_at_start = self._pauses, self._paused.is_set()
        return self._loop.run(_generate, self.engine, prompts, sampling, routing_shape, images,
                              lambda: paused_at_start or self._pauses != pauses,
                              self._adapters and self._adapters.current)

    def _engine_interrupt(self, paused: threading.Event) -> None:
        self._pauses += 1
        _interrupt(self.engine, paused)

    def _engine_open_update(self) -> None:
        self._loop.run(_begin_update, self.engine)

    def _engine_close_update(self, version: int) -> None:
        self._loop.run(_end_update, self.engine)

    def _engine_load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._loop.run(_update_from_tensor, self.engine, bucket)

    def _engine_join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> None:
        """SGLang's ``init_weights_update_group``: TP rank ``r`` joins as ``rank_offset + r``."""
        self._loop.run(_init_group, self.engine, master_address, master_port, rank_offset, world_size, group_name,
                       backend)

    def _engine_receive(self, metas: list[WeightMeta], group_name: str) -> None:
        self._loop.run(_update_from_distributed, self.engine, metas, group_name)

    def _engine_leave_group(self, group_name: str) -> None:
        self._loop.run(_destroy_group, self.engine, group_name)

    def _engine_drop_prefix_cache(self) -> bool:
        return self._loop.run(_flush_cache, self.engine)

    def _load_adapter(self, number: int, name: str, path) -> str:
        """SGLang loads the PEFT directory under ``name`` (never reused: it refuses a name it has loaded), which
        requests then name."""
        self._loop.run(_load_lora, self.engine, name, str(path))
        return name

    def _unload_adapter(self, name: str) -> None:
        self._loop.run(_unload_lora, self.engine, name)

    def _engine_sleep(self, level: int) -> None:
        """``release_memory_occupation`` of both; the weights survive only in the CPU backup, if enabled."""
        self._loop.run(_release, self.engine, ["kv_cache", "weights"])

    def _engine_wake(self, tags: list[str]) -> None:
        self._loop.run(_resume, self.engine, tags)

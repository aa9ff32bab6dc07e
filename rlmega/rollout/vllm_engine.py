"""``RolloutEngine`` over vLLM's offline ``LLM`` (vLLM >=0.33,<0.35, its V1 engine).

Two ways to get new weights in:

- colocated: ``update_weights(named_tensors, version)`` opens vLLM's own weight-update session
  (``LLM.start_weight_update``: layerwise reload on every worker), hands the tensors, bucket by bucket, to
  every worker through ``LLM.collective_rpc`` and the worker's ``model.load_weights``, and closes it with
  ``LLM.finish_weight_update(weight_version=...)``. With
  ``in_process=True`` (the default) the engine core runs in this process, so the tensors are passed by
  reference, never copied through a pipe.
- disaggregated: ``init_weight_update_group(...)`` joins the workers to a process group with one
  trainer rank (``rlmega.rollout.weight_group``), then ``begin_update`` / ``receive_weights(metas)`` /
  ``commit_update`` receive buckets that the trainer rank broadcasts with ``broadcast_weights``.
- vLLM's own ``sharded_rdt`` transfer (``weight_transfer="sharded_rdt"``): each worker pulls only its slices
  from the trainer ranks (``rlmega.sync.vllm_sharded``, which calls the ``native_transfer_*`` methods);
  the two ways above are then refused, since vLLM runs one weight-transfer backend per engine.

``lora_rank > 0`` (``sync.lora=adapters``) builds the engine with vLLM's LoRA kernels: updates then carry the trained
adapter (and base weights only when the base changed), which every request applies (``rlmega.rollout.vllm_lora``).

``record_routing=True`` builds the engine with ``enable_return_routed_experts`` (MoE routing replay, R3): every
``Generation`` then carries the experts its tokens went to (``Generation.routing``).

``pause_generation`` does not interrupt a running ``generate`` (see ``_engine_interrupt``): the running call
completes, and calls made while paused return "abort" at once without reaching vLLM.

Every call into vLLM is in the "vLLM 0.33 API" section below; README.md says what was checked where;
tests/rollout/fakes/api/vllm.json is what the wheel's source says of each call.
"""

from __future__ import annotations

import io
import math
import os
import threading

import torch

from rlmega.rollout.engine_common import (
    DEFAULT_BUCKET_BYTES,
    EngineAdapter,
    EngineResponse,
    ModelFacts,
    adapter_settings,
    check_version,
    image_token_runs,
)
from rlmega.rollout.engine_lock import runs_model, serialised
from rlmega.rollout.protocol import SamplingParams
from rlmega.rollout.lora_serving import ServedAdapter
from rlmega.rollout.vllm_lora import max_lora_rank
from rlmega.rollout.weight_group import WeightMeta
from rlmega.data.schema import ImageInputs
from rlmega.data.images import keeping_sizes

# setup.py's `vllm` extra: vllm>=0.33,<0.35 (0.34.0 changed nothing the adapter calls: both wheels' API snapshots,
# tests/rollout/fakes/api/vllm.json and vllm-0.34.json).
SUPPORTED_VERSIONS = ((0, 33), (0, 35))
# vLLM's weight-transfer backend the engine is built with: "nccl" for rlmega's own transports (its start / finish
# run the layerwise reload around rlmega's loads), "sharded_rdt" for rlmega.sync.vllm_sharded.
WEIGHT_TRANSFERS = ("nccl", "sharded_rdt")
WORKER_EXTENSION = "rlmega.rollout.vllm_engine.VLLMWorkerExtension"
# Taken when the caller sets no gpu_memory_utilization: 0.33's own default. 0.34's is 1.0 (all of the GPU: its
# extensible KV cache, vllm/config/cache.py), which leaves nothing to a trainer colocated on the same GPUs.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


# ---------------------------------------------------------------------------------------------- vLLM 0.33 API
# Checked against the vllm 0.33.0 wheel: vllm/entrypoints/llm.py (LLM.__init__, generate, collective_rpc,
# sleep, wake_up, reset_prefix_cache), vllm/entrypoints/rl/offline.py (RLOfflineMixin: start_weight_update,
# finish_weight_update), vllm/sampling_params.py, vllm/outputs.py (CompletionOutput), vllm/config/model.py
# (LogprobsMode), vllm/config/weight_transfer.py, vllm/config/lora.py (MaxLoRARanks), vllm/lora/request.py
# (LoRARequest), vllm/v1/engine/llm_engine.py (LLMEngine.add_lora / remove_lora),
# vllm/distributed/weight_transfer/nccl_engine.py (start / finish: layerwise reload), vllm/v1/worker/gpu_worker.py
# (the weight-transfer calls, model_runner), vllm/engine/arg_utils.py (worker_extension_cls, weight_transfer_config,
# enable_return_routed_experts, enable_lora, max_lora_rank, max_loras).
# Routed experts: vllm/model_executor/layers/fused_moe/routed_experts_capturer.py (the capture buffer:
# [tokens, num_hidden_layers, top-k], each MoE layer at its decoder-layer index, logical expert ids before
# EPLB; uint8 up to 256 experts, else uint16), vllm/distributed/aux_output_connector/connector.py (take_output:
# rows up to num_tokens - 1, the last sampled token never fed), vllm/v1/engine/output_processor.py (the rows
# concatenated on the final output), vllm/outputs.py (CompletionOutput.routed_experts), vllm/config/vllm.py
# (_verify_aux_output_compatibility: MoE models, prefix caching, no PP / context parallelism).
# Images (tests/rollout/fakes/api/vllm_multimodal.json): vllm/inputs/llm.py (TokensPrompt: prompt_token_ids,
# multi_modal_data, mm_processor_kwargs), vllm/multimodal/parse.py (MultiModalDataParser._parse_image_data: PIL
# images, arrays or 3-d tensors of pixels, or a dict of embeddings), vllm/model_executor/models/qwen2_vl.py
# (Qwen2VLMultiModalDataParser: a dict image item must hold image_embeds + image_grid_thw, never pixel_values;
# _complete_mm_processor_size_aliases: request min_pixels / max_pixels win over the checkpoint's) and
# qwen2_5_vl.py (Qwen2_5_VLMultiModalProcessor._get_prompt_updates: each image is ONE <|image_pad|> in the token
# prompt, which vLLM replaces by grid.prod() // merge**2 pads; vllm/multimodal/processing/processor.py applies the
# replacement to every prompt, so an already expanded run would be expanded again, pad by pad).

def _import_vllm():
    import vllm

    check_version("vllm", vllm.__version__, *SUPPORTED_VERSIONS)
    return vllm


def executor_backend(weight_transfer: str) -> str | None:
    """The vLLM executor a weight transfer needs (None: any). vLLM's sharded_rdt engine raises ``ValueError`` at
    construction unless ``distributed_executor_backend == "ray"``, the one executor whose workers are Ray actors
    with a tensor transport (vllm/distributed/weight_transfer/sharded_rdt_engine.py, ``__init__``); unset, vLLM
    picks "uni" for one GPU and "mp" for more (vllm/config/parallel.py)."""
    return "ray" if weight_transfer == "sharded_rdt" else None


# vllm/config/lora.py MaxLoRARanks (0.33.0 and 0.34.0): the ranks max_lora_rank may take.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _engine_settings(record_routing: bool, weight_transfer: str = "nccl", multimodal: bool = False,
                     lora_rank: int = 0) -> dict:
    """Engine arguments the adapter depends on."""
    routing = {"enable_return_routed_experts": True} if record_routing else {}
    # One adapter at a time (the current one), its rank rounded up to one vLLM builds kernels for.
    lora = {"enable_lora": True, "max_lora_rank": max_lora_rank(lora_rank, MAX_LORA_RANKS), "max_loras": 1} \
        if lora_rank else {}
    executor = executor_backend(weight_transfer)
    return {
        # Every request's CompletionOutput.routed_experts: [P + R - 1, num_hidden_layers, k] (no per-request
        # switch; SamplingParams.routed_experts_prompt_start, default 0, would skip prompt rows).
        **routing,
        **lora,
        **({"distributed_executor_backend": executor} if executor else {}),
        # Token ids in, token ids out: no tokenizer, no detokenizer. A multimodal model's processor is built at
        # construction and refuses to start without the tokenizer (vllm/multimodal/processing/processor.py:
        # BaseMultiModalProcessor.__init__, requires_tokenizer; built by vllm/renderers/base.py), so those load
        # it; the requests stay token ids in (prompt_token_ids) and out (detokenize=False).
        "skip_tokenizer_init": not multimodal,
        # Log-probs of the distribution sampled from (vllm/v1/sample/sampler.py: after temperature, then
        # top-k / top-p): the trainer scores the batch at the same temperature. With top-k / top-p set the
        # engine's log-probs include the truncation and the trainer's do not (README: Temperature).
        "logprobs_mode": "processed_logprobs",
        # LLM.sleep / wake_up raise without it.
        "enable_sleep_mode": True,
        # Our weight-loading methods, mixed into every worker.
        "worker_extension_cls": WORKER_EXTENSION,
        # Enables vLLM's weight-update session (start_weight_update / finish_weight_update raise without
        # it); the NCCL engine's start and finish run the layerwise reload around our loads.
        "weight_transfer_config": {"backend": weight_transfer},
    }


# vLLM loads several on-disk weights into one layer: packed_modules_mapping in vllm/model_executor/models/llama.py,
# qwen2.py, qwen3.py, qwen3_moe.py, mixtral.py, qwen2_5_vl.py ("qkv_proj", "gate_up_proj") and deepseek_v2.py
# ("fused_qkv_a_proj"); FusedMoE holds every expert of a layer (vllm/model_executor/layers/fused_moe/layer.py).
PACKED_LAYERS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj", "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}


def vllm_layer(name: str) -> str:
    """The vLLM layer an on-disk weight is loaded into: ``...self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj``,
    ``...mlp.experts.3.up_proj.weight`` -> ``...mlp.experts``, ``...o_proj.weight`` -> ``...o_proj``.

    The update session reloads layer by layer (vllm/model_executor/model_loader/reload/layerwise.py): each layer is
    rebuilt on the meta device and materialised once all its elements arrived; at ``finish_weight_update``
    (``finalize_layerwise_processing``) a layer that got only part of them is materialised from fresh,
    uninitialised memory with just those parts copied in."""
    parts = name.split(".")[:-1]  # the parameter (weight / bias) is part of its layer
    if "experts" in parts:
        index = parts.index("experts")
        if index + 1 < len(parts) and parts[index + 1].isdigit():
            return ".".join(parts[:index + 1])
    if parts and parts[-1] in PACKED_LAYERS:
        parts[-1] = PACKED_LAYERS[parts[-1]]
    return ".".join(parts)


def _new_llm(vllm, model: str, engine_kwargs: dict):
    return vllm.LLM(model=model, **engine_kwargs)


def _vllm_sampling_params(vllm, params: SamplingParams, seed: int | None):
    return vllm.SamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or 0,  # 0 disables
        seed=seed,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        # ignore_eos drops only the implicit EOS stop (and the generation_config's eos ids);
        # stop_token_ids still stop, and the stop token is kept in token_ids.
        ignore_eos=True,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )


def _decoded(encoded: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(encoded)) as image:
        return image.convert("RGB")


def _vllm_prompt(prompt: list[int], item: ImageInputs | None, facts: ModelFacts) -> dict:
    """A ``TokensPrompt``: the token ids, and for a prompt with images each image's pad run collapsed to one
    pad (vLLM expands it again from the grid of the image it processes), the images as PIL images in prompt
    order, and size limits that keep each image at the size it was shipped in (so the grid is the trainer's)."""
    if item is None:
        return {"prompt_token_ids": prompt}
    if item.images is None:
        raise ValueError("vLLM 0.33 takes a prompt's images only as images (multi_modal_data), not as pixel_values: "
                         "ImageInputs.images is missing; build the prompts with rlmega.data.images.ImagePrompts, "
                         "which keeps each image resized to its grid, or use the transformers or SGLang engine")
    runs = image_token_runs(prompt, facts.image_token_id)
    collapsed, previous = [], 0
    for start, length in runs:
        collapsed += prompt[previous:start + 1]
        previous = start + length
    collapsed += prompt[previous:]
    pictures = [_decoded(encoded) for encoded in item.images]
    for picture, (_, height, width) in zip(pictures, item.grid_thw.tolist()):
        if picture.size != (width * facts.patch_size, height * facts.patch_size):
            raise ValueError(f"an image of {picture.size[0]}x{picture.size[1]} pixels for grid {[height, width]} of "
                             f"{facts.patch_size}-pixel patches: ImageInputs.images must hold the resized images")
    limits = keeping_sizes(pictures)
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": pictures},
            "mm_processor_kwargs": {"min_pixels": limits["shortest_edge"], "max_pixels": limits["longest_edge"]}}


def _vllm_generate(llm, prompts: list[dict], sampling_params: list, lora_request=None) -> list[EngineResponse]:
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False, lora_request=lora_request)
    responses = []
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {output.request_id} with finish_reason "
                               f"{completion.finish_reason!r}")
        tokens = list(completion.token_ids)
        # logprobs[t] is {token id: Logprob} holding at least the sampled token.
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        # numpy [P + R - 1, num_hidden_layers, k] (uint8 / uint16) with enable_return_routed_experts, else None.
        responses.append(EngineResponse(tokens, logprobs, False, completion.routed_experts))
    return responses


def _lora_request(name: str, int_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def _add_lora(llm, request) -> None:
    # vllm/v1/engine/llm_engine.py add_lora: False when an adapter of that id is loaded already (ids are never reused).
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load LoRA adapter {request.lora_name} (id {request.lora_int_id})")


def _remove_lora(llm, int_id: int) -> None:
    llm.llm_engine.remove_lora(int_id)


def _start_update(llm) -> None:
    llm.start_weight_update()


def _finish_update(llm, version: int) -> None:
    llm.finish_weight_update(weight_version=str(version))


def _init_transfer(llm, init_info: dict) -> None:
    llm.init_weight_transfer_engine({"init_info": init_info})  # RLOfflineMixin takes the request as a dict too


def _transfer_update(llm, update_info: dict) -> None:
    llm.update_weights({"update_info": update_info})


def _load_weights(llm, bucket: list[tuple[str, torch.Tensor]]) -> None:
    llm.collective_rpc("rlmega_load_weights", args=(bucket,))


def _init_group(llm, master_address: str, master_port: int, rank_offset: int, world_size: int,
                group_name: str, backend: str) -> None:
    llm.collective_rpc("rlmega_init_weight_group",
                       args=(master_address, master_port, rank_offset, world_size, group_name, backend))


def _receive_weights(llm, metas: list[WeightMeta], group_name: str) -> None:
    llm.collective_rpc("rlmega_receive_weights", args=(metas, group_name))


def _destroy_group(llm, group_name: str) -> None:
    llm.collective_rpc("rlmega_destroy_weight_group", args=(group_name,))


def _drop_prefix_cache(llm) -> bool:
    # Cached KV blocks were computed with the old weights. False while a request holds blocks
    # (vllm/v1/core/block_pool.py, reset_prefix_cache); reset_running_requests=True would preempt them instead.
    return llm.reset_prefix_cache()


def _sleep(llm, level: int) -> None:
    llm.sleep(level=level)


def _wake_up(llm, tags: list[str]) -> None:
    llm.wake_up(tags=tags)


class VLLMWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); ``self`` is the worker, which owns
    ``model_runner.model``, ``device`` and ``rank``. Names are prefixed so they cannot shadow the worker's."""

    def rlmega_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.model.load_weights(weights=named_tensors)

    def rlmega_init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str) -> None:
        from rlmega.rollout.weight_group import init_weight_update_group

        groups = self.__dict__.setdefault("_rlmega_weight_groups", {})
        groups[group_name] = init_weight_update_group(master_address, master_port, rank_offset + self.rank,
                                                      world_size, group_name, backend)

    def rlmega_receive_weights(self, metas: list[WeightMeta], group_name: str) -> None:
        from rlmega.rollout.weight_group import receive_weights

        tensors = receive_weights(self._rlmega_weight_groups[group_name], metas, self.device)
        self.model_runner.model.load_weights(weights=tensors)

    def rlmega_destroy_weight_group(self, group_name: str) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self._rlmega_weight_groups.pop(group_name))

# ---------------------------------------------------------------------------------------------- end of vLLM API


class VLLMEngine(EngineAdapter):
    """Implements ``RolloutEngine`` on ``vllm.LLM`` (the shared logic is ``EngineAdapter``'s).

    ``model`` is a local Hugging Face checkpoint directory (safetensors): its headers give the weight
    names and shapes that ``update_weights`` checks before anything reaches vLLM. ``engine_kwargs`` go
    to ``vllm.LLM`` (``tensor_parallel_size``, ``gpu_memory_utilization`` (default
    ``DEFAULT_GPU_MEMORY_UTILIZATION``, on 0.34 too), ``dtype``, ``seed``, ...);
    the settings in ``_engine_settings`` are the adapter's and may not be changed.
    ``in_process=True`` runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    ``record_routing=True`` (a MoE checkpoint only: a dense one raises ``ValueError`` here) makes every
    ``Generation`` carry ``routing``, ``[P + R, M, k]`` int16 (vLLM then needs prefix caching, its default,
    and refuses pipeline or context parallelism). ``weight_transfer`` is vLLM's weight-transfer backend
    (``WEIGHT_TRANSFERS``): ``"nccl"`` for rlmega's transports, ``"sharded_rdt"`` for ``ShardedSync``.
    ``weight_dtype="fp8"``: vLLM serves blockwise FP8 from an FP8 copy of the checkpoint (``EngineAdapter``);
    updates are quantized on the way in.
    ``lora_rank > 0``: vLLM's LoRA is enabled for adapters of up to that rank; an update's adapter tensors (PEFT names,
    ``rlmega.rollout.vllm_lora``) are written as a PEFT directory under ``lora_dir`` (default: a directory of its own
    in /dev/shm) and loaded at the commit, replacing the one before; every request then applies it.
    """

    engine_name = "vllm"

    def __init__(self, model: str | os.PathLike, *, in_process: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, record_routing: bool = False,
                 weight_transfer: str = "nccl", weight_dtype: str = "auto", lora_rank: int = 0,
                 lora_dir: str | None = None, **engine_kwargs):
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"VLLMEngine weight_transfer={weight_transfer!r}: choose one of {list(WEIGHT_TRANSFERS)}")
        executor = executor_backend(weight_transfer)
        if executor and engine_kwargs.get("distributed_executor_backend", executor) != executor:
            raise ValueError(f"VLLMEngine weight_transfer={weight_transfer!r} needs distributed_executor_backend="
                             f"{executor!r} (vLLM refuses to start it with any other executor), got "
                             f"{engine_kwargs['distributed_executor_backend']!r}")
        self._vllm = _import_vllm()
        self.weight_transfer = weight_transfer
        super().__init__(model, bucket_bytes=bucket_bytes, engine_version=self._vllm.__version__,
                         record_routing=record_routing, weight_dtype=weight_dtype)
        engine_kwargs.setdefault("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
        if lora_rank and (weight_transfer != "nccl" or weight_dtype != "auto"):
            raise ValueError(f"VLLMEngine lora_rank={lora_rank} takes its adapters through rlmega's own transports "
                             f"onto base weights of the checkpoint's dtype: weight_transfer={weight_transfer!r} and "
                             f"weight_dtype={weight_dtype!r} must be 'nccl' and 'auto'")
        engine_kwargs = adapter_settings("VLLMEngine", engine_kwargs, _engine_settings(
            record_routing, weight_transfer, multimodal=self.facts.image_token_id is not None, lora_rank=lora_rank))
        if lora_rank:
            self._adapters = ServedAdapter(self._add_adapter,
                                           lambda request: _remove_lora(self.llm, request.lora_int_id), lora_dir)
        self._workers = math.prod(int(engine_kwargs.get(key) or 1) for key in (
            "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
        self._layers: dict[str, set[str]] = {}  # vLLM layer -> the on-disk names loaded into it
        for name in self.weights.shapes:
            self._layers.setdefault(vllm_layer(name), set()).add(name)
        self._session_names: set[str] = set()  # on-disk names sent since begin_update
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the LLM is built
        self.llm = _new_llm(self._vllm, str(self.model_path), engine_kwargs)

    # ------------------------------------------------------------------ engine calls: the vLLM 0.33 API above

    def _engine_generate(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None],
                         images: list[ImageInputs | None] | None = None) -> list[EngineResponse]:
        images = images or [None] * len(prompts)
        return _vllm_generate(self.llm, [_vllm_prompt(prompt, item, self.facts) for prompt, item in zip(prompts, images)],
                              [_vllm_sampling_params(self._vllm, p, seed) for p, seed in zip(params, seeds)],
                              self._adapters and self._adapters.current)

    def _engine_interrupt(self, paused: threading.Event) -> None:
        """Nothing: a running ``generate`` completes ("stop" / "length") and only later calls see the pause.
        Read for 0.11; in 0.33 ``LLM._run_engine`` still steps the engine in the caller's thread, and its
        aborts (``LLMEngine.abort_request``, ``LLM.sleep(level=0, mode="abort")``) are not documented as safe
        from another thread while it steps (not yet checked on a GPU).

        ``LLM.generate`` steps the engine in the caller's thread until every request is done
        (``LLM._run_engine`` in vllm/entrypoints/llm.py). Its one abort, ``LLMEngine.abort_request``
        (vllm/v1/engine/llm_engine.py), is not safe from another thread: it mutates the ``OutputProcessor``
        and, in process, the scheduler (``InprocClient.abort_requests`` -> ``EngineCore.abort_requests``)
        while ``step()`` uses them, without a lock; and it discards the partial response, since
        ``OutputProcessor.abort_requests`` emits a final output only into an ``AsyncLLM`` request's queue.
        Interrupting with the partial response kept needs vLLM's ``AsyncLLM`` (vllm/v1/engine/async_llm.py:
        ``generate`` streaming outputs, ``abort(request_id)``)."""

    def _engine_open_update(self) -> None:
        _start_update(self.llm)

    def _engine_close_update(self, version: int) -> None:
        _finish_update(self.llm, version)

    def _engine_load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._session_names.update(self.weights.check(name, tensor) for name, tensor in bucket)
        _load_weights(self.llm, bucket)

    def _engine_join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> None:
        _init_group(self.llm, master_address, master_port, rank_offset, world_size, group_name, backend)

    def _engine_receive(self, metas: list[WeightMeta], group_name: str) -> None:
        self._session_names.update(self.weights.check(name, torch.empty(shape, device="meta"))
                                   for name, _, shape in metas)
        _receive_weights(self.llm, metas, group_name)

    def _engine_leave_group(self, group_name: str) -> None:
        _destroy_group(self.llm, group_name)

    def _engine_drop_prefix_cache(self) -> bool:
        return _drop_prefix_cache(self.llm)

    def _engine_sleep(self, level: int) -> None:
        """``LLM.sleep(level)``: level 1 offloads the weights to host memory and drops the KV cache; level 2
        drops both. vLLM cannot re-sleep, so level 1 then 2 keeps the host copy (the bookkeeping still
        requires a full re-sync)."""
        _sleep(self.llm, level)

    def _engine_wake(self, tags: list[str]) -> None:
        """``LLM.wake_up`` (weights first: vLLM restores buffers into them). The KV blocks that the prefix
        cache indexed did not survive the sleep, so it is dropped too."""
        _wake_up(self.llm, tags)
        if "kv_cache" in tags:
            _drop_prefix_cache(self.llm)

    # ------------------------------------------------------------------ weights through vLLM's sharded_rdt

    @runs_model
    def begin_update(self, version: int) -> None:
        if self.weight_transfer != "nccl":
            raise RuntimeError(f"this vLLM engine was built with weight_transfer={self.weight_transfer!r}: vLLM runs "
                               "one weight-transfer backend per engine, so its weights come through "
                               "rlmega.sync.vllm_sharded.ShardedSync; build it with weight_transfer='nccl' for "
                               "rlmega's own transports")
        super().begin_update(version)
        self._session_names = set()

    @serialised
    def commit_update(self) -> None:
        """Refuses (``ValueError``, the update left torn) an update that sent part of a vLLM layer: vLLM would
        rebuild the rest of it from uninitialised memory (``vllm_layer``). An update that brought an adapter has
        vLLM load it before the version commits (``EngineAdapter.commit_update``)."""
        self._check_whole_layers()
        super().commit_update()
        self._session_names = set()

    def _add_adapter(self, number: int, name: str, path):
        """vLLM loads the PEFT directory as a new ``LoRARequest`` (its id: ``number``, never reused)."""
        request = _lora_request(name, number, str(path))
        _add_lora(self.llm, request)
        return request

    def _check_whole_layers(self) -> None:
        for layer in sorted({vllm_layer(name) for name in self._session_names}):
            missing = sorted(self._layers[layer] - self._session_names)
            if missing:
                sent = sorted(self._layers[layer] & self._session_names)
                raise ValueError(
                    f"the update to version {self._book.pending} sent {', '.join(sent[:3])}"
                    f"{' ...' if len(sent) > 3 else ''} without {', '.join(missing[:3])}"
                    f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}: vLLM loads them into one layer "
                    f"({layer}) and rebuilds a partly sent layer from uninitialised memory; send every weight of "
                    f"the layer in the same update (the engine refuses to generate until an update completes)")

    def native_transfer_workers(self) -> int:
        """The engine's workers (tensor x pipeline x data parallel): vLLM's consumers of one engine."""
        return self._workers

    def _require_native(self) -> None:
        if self.weight_transfer == "nccl":
            raise RuntimeError("this vLLM engine was built for rlmega's own transports (weight_transfer='nccl'); "
                               f"ShardedSync needs VLLMEngine(..., weight_transfer={WEIGHT_TRANSFERS[1]!r})")

    @serialised
    def native_transfer_init(self, init_info: dict) -> None:
        """Hand the workers the trainer's plan (``ShardedRDTWeightTransferInitInfo`` as a dict)."""
        self._require_native()
        _init_transfer(self.llm, init_info)

    @serialised
    def native_transfer_start(self, version: int) -> None:
        """Open vLLM's update as ``version``: from here until ``native_transfer_finish`` the weights are mixed."""
        self._require_native()
        self._updates.begin(version)
        self._book.sending()  # as for any update: the version marked torn, weights woken, vLLM's update opened
        self._prepare_engine()

    @serialised
    def native_transfer_update(self, update_info: dict) -> None:
        """Blocks until every worker has pulled every group (vLLM's ``update_weights``)."""
        _transfer_update(self.llm, update_info)

    @serialised
    def native_transfer_finish(self) -> None:
        """Close the update: every weight was pulled, so the version commits (also after a level-2 sleep)."""
        self._book.sent(self._book.names)
        self.commit_update()

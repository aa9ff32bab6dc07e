"""A stand-in for the ``sglang`` package (0.5.3), installed as ``sys.modules["sglang"]`` by the tests.

``Engine``'s methods and signatures are SGLang 0.5.3's, from its wheel (sglang/srt/entrypoints/engine.py).
Behaviour the adapter relies on is reproduced: sampling-parameter dicts as in
sglang/srt/sampling/sampling_params.py (temperature 0 -> top_k 1, top_k -1 for all, ``sampling_seed``
used only with ``enable_deterministic_inference``); Req.check_finished in
sglang/srt/managers/schedule_batch.py (length tested first; ``ignore_eos`` disables the EOS ids *and*
``stop_token_ids``); the log-probs of sglang/srt/layers/sampler.py (``log_softmax(logits / temperature)``
unless ``RETURN_ORIGINAL_LOGPROB`` was set when the engine started); update calls returning
``(success, message)``; release/resume of the "weights" and "kv_cache" tags, which free nothing without
``enable_memory_saver`` and keep the weights only with ``enable_weights_cpu_backup``. Calls are recorded
in ``calls``.

Threads and aborts, as in 0.5.3: every method runs on ``asyncio.get_event_loop()`` (none in a thread that
has not set one), and the TokenizerManager binds to the loop of its first call (auto_create_handle_loop),
so a call on another loop fails. ``TokenizerManager.abort_request`` must run on that loop (it sends on the
loop's zmq socket). The scheduler (here: decoding in an executor thread, one request after another) aborts
what it holds (Scheduler.abort_request): a queued request comes back without ``output_ids``
(TokenizerManager._handle_abort_req), a running one after one more token, with its tokens and log-probs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from rlmega.rollout.weight_group import init_weight_update_group, receive_weights

from .tiny_backend import TinyCausalLM

__version__ = "0.5.3"


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

    def __init__(self):
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None
        self.rid_to_state: dict[str, threading.Event] = {}  # requests the scheduler holds -> their to_abort
        self.aborts = 0  # AbortReq messages sent

    def auto_create_handle_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_event_loop()  # RuntimeError in a thread without a loop, as in SGLang
        if self.event_loop is None:
            self.event_loop = loop
        elif loop is not self.event_loop:
            raise RuntimeError("the TokenizerManager's handle loop and zmq sockets are attached to a different loop")
        return loop

    def abort_request(self, rid: str = "", abort_all: bool = False):
        if asyncio.get_running_loop() is not self.event_loop:  # RuntimeError outside any loop
            raise RuntimeError("abort_request sends on the handle loop's zmq socket: call it on that loop")
        self.aborts += 1
        for request_id, to_abort in self.rid_to_state.items():
            if abort_all or request_id.startswith(rid):
                to_abort.set()


class Engine:
    def __init__(self, **kwargs):
        self.server_args = kwargs
        self.tokenizer_manager = TokenizerManager()
        self._rids = itertools.count()
        self.calls: list[tuple] = [("__init__", dict(kwargs))]
        self.model = TinyCausalLM(kwargs["model_path"])
        self._eos = _eos_ids(kwargs["model_path"])
        # Read by the scheduler processes when they import sglang/srt/layers/sampler.py.
        self._raw_logprobs = os.environ.get("RETURN_ORIGINAL_LOGPROB", "false").lower() in ("1", "true")
        self._released: set[str] = set()
        self._backup: list[torch.Tensor] = []
        self._groups: dict = {}

    def generate(self, prompt: Optional[Union[List[str], str]] = None,
                 sampling_params: Optional[Union[List[Dict], Dict]] = None,
                 input_ids: Optional[Union[List[List[int]], List[int]]] = None, image_data=None, audio_data=None,
                 video_data=None, return_logprob: Optional[Union[List[bool], bool]] = False,
                 logprob_start_len: Optional[Union[List[int], int]] = None,
                 top_logprobs_num: Optional[Union[List[int], int]] = None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, return_hidden_states: bool = False, stream: bool = False,
                 bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None):
        loop = self.tokenizer_manager.auto_create_handle_loop()
        if self._released:
            raise RuntimeError("generate called while memory is released")
        self.calls.append(("generate", input_ids, sampling_params, return_logprob, logprob_start_len))
        return loop.run_until_complete(self._in_scheduler(loop, input_ids, sampling_params, return_logprob))

    async def _in_scheduler(self, loop, input_ids, sampling_params, return_logprob):
        requests = [(str(next(self._rids)), ids, params, threading.Event())
                    for ids, params in zip(input_ids, sampling_params)]
        self.tokenizer_manager.rid_to_state.update({rid: to_abort for rid, _, _, to_abort in requests})
        try:
            return await loop.run_in_executor(None, self._decode, requests, return_logprob)
        finally:
            for rid, _, _, _ in requests:
                del self.tokenizer_manager.rid_to_state[rid]

    def _decode(self, requests, return_logprob):
        outputs = []
        for rid, ids, params, to_abort in requests:
            if to_abort.is_set():  # still queued: popped from the waiting queue
                outputs.append({"text": "", "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                    "prompt_tokens": 0, "completion_tokens": 0}})
                continue
            temperature, top_k = params.get("temperature", 1.0), params.get("top_k", -1)
            if 0 <= temperature < 1e-6:
                temperature, top_k = 1.0, 1
            seed = params.get("sampling_seed", 42) if self.server_args.get("enable_deterministic_inference") else None
            stop_ids = set() if params.get("ignore_eos") else set(params.get("stop_token_ids") or []) | self._eos
            for _ in range(params.get("n", 1)):  # parallel samples share the seed
                tokens, logprobs, reason = self.model.decode(
                    ids, max_tokens=params.get("max_new_tokens", 128), stop_ids=stop_ids, temperature=temperature,
                    top_k=top_k, top_p=params.get("top_p", 1.0), seed=seed,
                    logprobs_of="raw" if self._raw_logprobs else "scaled", aborted=to_abort.is_set)
                finish = {"stop": {"type": "stop", "matched": tokens[-1]},
                          "length": {"type": "length", "length": params.get("max_new_tokens", 128)},
                          "abort": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                          }[reason]
                meta = {"id": str(rid), "finish_reason": finish, "prompt_tokens": len(ids),
                        "completion_tokens": len(tokens), "cached_tokens": 0}
                if return_logprob:
                    meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, tokens)]
                outputs.append({"output_ids": tokens, "meta_info": meta})
        return outputs

    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, torch.Tensor]],
                                   load_format: Optional[str] = None, flush_cache: bool = True):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("update_weights_from_tensor", [name for name, _ in named_tensors], load_format,
                           flush_cache))
        if "weights" in self._released:
            raise RuntimeError("scheduler died: weights written while their memory is released")
        self.model.load_weights(named_tensors)  # a bad name kills the scheduler process in SGLang
        return True, "Success"

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl"):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                           group_name, backend))
        self._groups[group_name] = init_weight_update_group(master_address, master_port, rank_offset + 0, world_size,
                                                            group_name, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name: str):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("destroy_weights_update_group", group_name))
        if group_name not in self._groups:
            return False, "The group to be destroyed does not exist."
        torch.distributed.destroy_process_group(self._groups.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("update_weights_from_distributed", names, dtypes, shapes, group_name, flush_cache))
        if group_name not in self._groups:
            return False, f"Group {group_name} not in {list(self._groups)}"
        if "weights" in self._released:
            raise RuntimeError("scheduler died: weights written while their memory is released")
        self.model.load_weights(receive_weights(self._groups[group_name], list(zip(names, dtypes, shapes)), "cpu"))
        return True, "Succeeded to update parameter online."

    def flush_cache(self):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("flush_cache",))
        return True

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("release_memory_occupation", tags))
        tags = tags or ["weights", "kv_cache"]
        if not self.server_args.get("enable_memory_saver"):
            return  # the memory saver adapter is a no-op
        if "weights" in tags:
            params = self.model.parameters()
            self._backup = [p.data.clone() for p in params] if self.server_args.get("enable_weights_cpu_backup") else []
            for p in params:
                p.data.fill_(float("nan"))
        self._released.update(tags)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("resume_memory_occupation", tags))
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and "weights" in self._released:
            for p, saved in zip(self.model.parameters(), self._backup):
                p.data.copy_(saved)
        self._released.difference_update(tags)

    def shutdown(self):
        self.calls.append(("shutdown",))

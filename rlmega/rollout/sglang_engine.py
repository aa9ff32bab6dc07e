"""``RolloutEngine`` over SGLang's offline ``sglang.Engine`` (SGLang >=0.5.3,<0.6).

Two ways to get new weights in:

- colocated: ``update_weights(named_tensors, version)`` sends checked buckets with
  ``Engine.update_weights_from_tensor`` (which serialises them for the scheduler processes: CUDA IPC
  handles for GPU tensors) and flushes the radix cache once, at the commit.
- disaggregated: ``init_weight_update_group(...)`` (SGLang's ``init_weights_update_group``), then
  ``begin_update`` / ``receive_weights(metas)`` / ``commit_update`` while the trainer rank broadcasts each
  bucket with ``rlmega.rollout.weight_group.broadcast_weights``.

Every call into SGLang is in the "SGLang 0.5.3 API" section below; README.md says what was checked where.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from rlmega.rollout.engine_common import (
    DEFAULT_BUCKET_BYTES,
    CheckpointWeights,
    ModelFacts,
    WeightBook,
    check_requests,
    check_version,
    checked_buckets,
    finish_response,
    sample_requests,
    sample_seed,
)
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.rollout.weight_group import DEFAULT_GROUP_NAME, WeightMeta

SUPPORTED_VERSIONS = ((0, 5, 3), (0, 6))  # setup.py's `sglang` extra: sglang>=0.5.3,<0.6


# ---------------------------------------------------------------------------------------------- SGLang 0.5.3 API
# Checked against the sglang 0.5.3 wheel: sglang/srt/entrypoints/engine.py (Engine: generate,
# update_weights_from_tensor, init_weights_update_group, update_weights_from_distributed, flush_cache,
# release_memory_occupation, resume_memory_occupation, shutdown), sglang/srt/sampling/sampling_params.py,
# sglang/srt/layers/sampler.py (which log-probs are returned), sglang/srt/managers/schedule_batch.py
# (Req.check_finished), sglang/srt/managers/tokenizer_manager.py (output dicts), sglang/srt/server_args.py.

# sglang/srt/layers/sampler.py reads it when the scheduler processes import it: with it, the returned
# log-probs are log(softmax(raw logits)); without it, log(softmax(logits / temperature)) whenever a batch
# holds a sampled (temperature > 0) request.
RAW_LOGPROB_ENV = "RETURN_ORIGINAL_LOGPROB"


def _import_sglang():
    import sglang

    check_version("sglang", sglang.__version__, *SUPPORTED_VERSIONS)
    return sglang


def _engine_settings() -> dict:
    """Server arguments the adapter depends on."""
    return {
        "skip_tokenizer_init": True,  # token ids in and out
        "enable_memory_saver": True,  # without it release_memory_occupation frees nothing
    }


def _new_engine(sglang, model: str, server_kwargs: dict):
    if os.environ.get(RAW_LOGPROB_ENV, "1").lower() not in ("1", "true"):
        warnings.warn(f"{RAW_LOGPROB_ENV}={os.environ[RAW_LOGPROB_ENV]!r} overridden: the adapter needs raw-logit "
                      f"log-probs")
    os.environ[RAW_LOGPROB_ENV] = "1"  # inherited by the scheduler processes the engine spawns
    return sglang.Engine(model_path=model, **server_kwargs)


def _sampling_params(params: SamplingParams, seed: int | None, ignore_eos: bool) -> dict:
    sampling = {
        "n": 1,
        "temperature": params.temperature,  # 0 becomes top_k=1 inside SGLang
        "top_p": params.top_p,
        "top_k": params.top_k or -1,  # -1 disables
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        # ignore_eos also disables stop_token_ids in 0.5.3 (Req.check_finished): see SGLangEngine.generate.
        "ignore_eos": ignore_eos,
        "no_stop_trim": True,  # keep the stop token
    }
    if seed is not None:
        sampling["sampling_seed"] = seed % 2**31  # an int32 tensor inside SGLang
    return sampling


def _generate(engine, prompts: list[list[int]], sampling: list[dict]) -> list[tuple[list[int], list[float]]]:
    outputs = engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True,
                              logprob_start_len=-1)  # -1: no prompt log-probs
    responses = []
    for output in outputs:
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] not in ("stop", "length"):
            raise RuntimeError(f"SGLang ended request {meta.get('id')} with {meta['finish_reason']}")
        tokens = list(output["output_ids"])
        # (logprob, token id, text or None) per generated token
        logprobs = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
        responses.append((tokens, logprobs))
    return responses


def _checked(result, what: str) -> None:
    """The update calls return ``(success, message)`` instead of raising."""
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


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


def _flush_cache(engine) -> None:
    engine.flush_cache()  # the radix cache holds KV computed with the old weights


def _release(engine, tags: list[str]) -> None:
    engine.release_memory_occupation(tags=tags)


def _resume(engine, tags: list[str]) -> None:
    engine.resume_memory_occupation(tags=tags)

# ---------------------------------------------------------------------------------------------- end of SGLang API


class SGLangEngine:
    """Implements ``RolloutEngine`` on ``sglang.Engine``.

    ``model`` is a local Hugging Face checkpoint directory (safetensors): its headers give the weight
    names and shapes that ``update_weights`` checks before anything reaches SGLang (whose loader fails
    inside the scheduler process). ``server_kwargs`` go to ``sglang.Engine`` (``tp_size``,
    ``mem_fraction_static``, ``dtype``, ...). Two of them matter to the protocol:
    ``enable_weights_cpu_backup=True`` is required for ``sleep(level=1)``, and seeded sampling is
    reproducible only with ``enable_deterministic_inference=True`` (SGLang ignores per-request seeds
    otherwise).
    """

    def __init__(self, model: str | os.PathLike, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **server_kwargs):
        self._sglang = _import_sglang()
        settings = _engine_settings()
        clashes = {key for key, value in settings.items() if key in server_kwargs and server_kwargs[key] != value}
        if clashes:
            raise ValueError(f"SGLangEngine sets {sorted(clashes)} itself ({ {k: settings[k] for k in sorted(clashes)} })")
        self.model_path = Path(model)
        self.facts = ModelFacts.from_checkpoint(self.model_path)
        self.weights = CheckpointWeights.from_checkpoint(self.model_path, self.facts)
        self.bucket_bytes = bucket_bytes
        self.keeps_weights_asleep = bool(server_kwargs.get("enable_weights_cpu_backup", False))
        self._book = WeightBook(self.weights.shapes)
        self._released: set[str] = set()  # of "weights", "kv_cache"
        self._group_name = DEFAULT_GROUP_NAME
        self.engine = _new_engine(self._sglang, str(self.model_path), {**server_kwargs, **settings})

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        """See ``RolloutEngine.generate``.

        SGLang always stops at the checkpoint's EOS ids unless ``ignore_eos``, which also disables
        ``stop_token_ids``. A request whose stop ids cover every EOS id runs as is; any other runs with
        ``ignore_eos`` to ``max_new_tokens`` and is cut after its first stop token here: exact, but it
        decodes past the stop.
        """
        self._book.check_ready()
        per_prompt = check_requests(prompts, params, self.facts)
        requests = sample_requests(per_prompt)
        if not requests:
            return []
        sampling = []
        for i, j in requests:
            p = per_prompt[i]
            sampling.append(_sampling_params(p, sample_seed(p.seed, i, j),
                                             ignore_eos=not self.facts.eos_token_ids <= set(p.stop_token_ids)))
        responses = _generate(self.engine, [prompts[i] for i, _ in requests], sampling)
        generations = []
        for (i, _), (tokens, logprobs) in zip(requests, responses):
            p = per_prompt[i]
            tokens, logprobs, reason = finish_response(tokens, logprobs, p.stop_token_ids, p.max_new_tokens)
            generations.append(Generation(prompt_index=i, response_token_ids=tokens, logprobs=logprobs,
                                          finish_reason=reason, weight_version=self._book.version))
        return generations

    # ------------------------------------------------------------------ weights, colocated

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """See ``RolloutEngine.update_weights``."""
        self.begin_update(version)
        self.write_weights(named_tensors)
        self.commit_update()

    def begin_update(self, version: int) -> None:
        self._book.begin(version)

    def write_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for bucket, slots in checked_buckets(named_tensors, self.weights, self.bucket_bytes):
            self._resume_weights()
            self._book.sending()
            _update_from_tensor(self.engine, bucket)
            self._book.sent(slots)

    def commit_update(self) -> None:
        self._book.commit()
        if "kv_cache" not in self._released:
            _flush_cache(self.engine)

    # ------------------------------------------------------------------ weights, disaggregated

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> None:
        """SGLang's ``init_weights_update_group``: TP rank ``r`` joins as ``rank_offset + r``. Collective: the
        trainer rank calls ``weight_group.init_weight_update_group(..., rank=0)`` meanwhile."""
        _init_group(self.engine, master_address, master_port, rank_offset, world_size, group_name, backend)
        self._group_name = group_name

    def destroy_weight_update_group(self) -> None:
        _destroy_group(self.engine, self._group_name)

    def receive_weights(self, metas: Sequence[WeightMeta]) -> None:
        """Receive one bucket that the trainer rank broadcasts (``weight_group.broadcast_weights``), between
        ``begin_update`` and ``commit_update``. ``metas`` are ``weight_group.weight_meta(bucket)``."""
        metas = [(name, dtype, tuple(shape)) for name, dtype, shape in metas]
        slots = {self.weights.check(name, torch.empty(shape, device="meta")) for name, _, shape in metas}
        if not metas:
            return
        self._resume_weights()
        self._book.sending()
        _update_from_distributed(self.engine, metas, self._group_name)
        self._book.sent(slots)

    def weight_version(self) -> int:
        return self._book.version

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int = 1) -> None:
        """``release_memory_occupation`` of the weights and the KV cache. Level 1 needs the engine built
        with ``enable_weights_cpu_backup=True`` (the weights come back on wake); level 2 requires a full
        re-sync whatever the backup."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 1 and not self.keeps_weights_asleep and self._book.sleep_level < 2:
            raise ValueError("sleep(level=1) keeps the weights, which SGLang does only when the engine is built "
                             "with enable_weights_cpu_backup=True; use sleep(level=2) and re-sync instead")
        if not self._released and self._book.sleep_level == 0:
            _release(self.engine, ["kv_cache", "weights"])
            self._released = {"weights", "kv_cache"}
        self._book.slept(level)

    def wake(self) -> None:
        if self._released:
            _resume(self.engine, sorted(self._released, key=["weights", "kv_cache"].index))
            self._released.clear()
        self._book.sleep_level = 0

    def _resume_weights(self) -> None:
        if "weights" in self._released:
            _resume(self.engine, ["weights"])
            self._released.discard("weights")

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes."""
        self.engine.shutdown()

    def health(self) -> dict:
        return {
            **self._book.health(),
            "asleep": sorted(self._released),
            "engine": "sglang",
            "engine_version": self._sglang.__version__,
            "model_type": self.weights.model_type,
        }

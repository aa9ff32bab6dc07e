"""The rollout engines' own rules on how an engine is laid out, checked when the config loads, before any starts.

Data parallelism inside one engine: vLLM 0.33 / 0.34 refuse ``LLM(data_parallel_size > 1)`` in one process
(vllm/entrypoints/llm.py, ``LLM.__init__``: "not supported for single-process usage"), and SGLang 0.5.23 starts
with ``dp_size > 1`` but asserts ``dp_size == 1`` in every weight-update entry point
(sglang/srt/managers/tokenizer_control_mixin.py). rlmega already runs several engines and spreads the prompts over
them, so replicas are separate engines: ``rollout.num_engines``.

Context length: a vLLM / SGLang engine ends a request at its context length (``max_model_len`` / ``context_length``)
with finish reason "length", so a user setting below prompt + response would cut every long response short.
"""

from __future__ import annotations

from rlmega.config.schema import RLConfig

# The engine argument that bounds prompt + response, per backend.
CONTEXT_LENGTH_ARGUMENT = {"vllm": "max_model_len", "sglang": "context_length"}


def layout_problems(config: RLConfig) -> list[tuple[str, str]]:
    """``(field, what is wrong and how to fix it)`` for each engine layout setting the engines cannot run."""
    rollout, problems = config.rollout, []
    if rollout.backend in ("vllm", "sglang") and rollout.data_parallel_size > 1:
        engines = rollout.num_engines * rollout.data_parallel_size
        why = ("vLLM refuses data_parallel_size > 1 inside one process" if rollout.backend == "vllm" else
               "SGLang refuses weight updates to an engine with dp_size > 1")
        problems.append(("rollout.data_parallel_size",
                         f"{why}; run the replicas as separate engines: set rollout.data_parallel_size=1 and "
                         f"rollout.num_engines={engines} (rlmega spreads the prompts over its engines)"))
    argument = CONTEXT_LENGTH_ARGUMENT.get(rollout.backend)
    limit = rollout.engine_kwargs.get(argument) if argument else None
    needed = config.data.max_prompt_length + rollout.max_new_tokens
    if limit is not None and int(limit) < needed:
        problems.append((f"rollout.engine_kwargs.{argument}",
                         f"{limit} is below data.max_prompt_length + rollout.max_new_tokens = {needed}, so the engine "
                         f"would cut long responses short (finish reason 'length'); set it to at least {needed}, or "
                         "remove it to use the model's"))
    return problems

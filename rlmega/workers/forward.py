"""Log-probs of given token sequences under a sharded Megatron model, through Megatron's schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmega.models.spec import ModelSpec
from rlmega.workers.batching import SequenceBatch, build_micro_batch, row_multiple
from rlmega.workers.context_parallel import split_micro_batch
from rlmega.workers.heads import logprob_head
from rlmega.workers.logprobs import DEFAULT_CHUNK_TOKENS
from rlmega.workers.passes import run_schedule


def sequence_logprobs(chunks: list, spec: ModelSpec, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """``log p(x_t | x_<t)`` for t = 1..len-1 of each sequence ``[len]``, on every rank.

    Collective over the model's ranks, which all score every sequence (no data-parallel split).
    Runs forward-only through Megatron's pipeline schedule, one sequence per call (lengths
    differ), split over context-parallel ranks like the worker's micro-batches; log-probs come
    from the vocabulary-parallel logits on the last stage and are broadcast to all stages.
    """
    from megatron.core import parallel_state as ps

    config = chunks[0].config
    cp = ps.get_context_parallel_world_size()
    multiple = row_multiple(ps.get_tensor_model_parallel_world_size(), config.sequence_parallel, cp)
    batch = SequenceBatch(list(sequences), [1] * len(sequences))  # every token after the first is scored
    head = logprob_head(spec.vocab_size, DEFAULT_CHUNK_TOKENS)
    results = []
    for index, sequence in enumerate(sequences):
        micro_batch = build_micro_batch(batch, [index], packing=False, pad_to_multiple=multiple, vision=spec.vision)
        if cp > 1:
            micro_batch = split_micro_batch(micro_batch, cp, ps.get_context_parallel_rank())
        with torch.no_grad():
            (result,) = run_schedule(chunks, [micro_batch], head, forward_only=True)
        logprobs = result.outputs["logprobs"].float().cpu() if result is not None else torch.empty(sequence.numel() - 1)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            last_stage = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
            dist.broadcast(logprobs, src=last_stage, group=group)
        results.append(logprobs)
    return results

"""Log-probs of given token sequences under a sharded Megatron model, through Megatron's schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmega.models.spec import ModelSpec
from rlmega.workers.logprobs import vocab_parallel_logprobs


def sequence_logprobs(chunks: list, spec: ModelSpec, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """``log p(x_t | x_<t)`` for t = 1..len-1 of each sequence ``[len]``, on every rank.

    Collective over the model's ranks. Runs forward-only through Megatron's pipeline schedule (one
    sequence per micro-batch, so lengths may differ), computes log-probs from the vocabulary-parallel
    logits on the last stage without gathering the vocabulary, and broadcasts them to all ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()

    def forward_step(iterator, model):
        tokens = next(iterator).unsqueeze(0)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        logits = model(tokens, positions, None)

        def score(output):
            local = output[0, :-1].float()
            logprobs, _ = vocab_parallel_logprobs(
                local, tokens[0, 1:], vocab_size=spec.vocab_size, vocab_start=tp_rank * local.shape[-1], group=tp_group
            )
            return output.sum() * 0, {"logprobs": logprobs.detach()}

        return logits, score

    results = []
    for sequence in sequences:  # one schedule call per sequence: sequence lengths differ
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([sequence]) for _ in chunks] if len(chunks) > 1 else iter([sequence]),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=1, seq_length=sequence.shape[0], micro_batch_size=1, forward_only=True,
        )
        logprobs = outputs[0]["logprobs"] if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.empty(sequence.shape[0] - 1)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            last_stage = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size() - 1)
            dist.broadcast(logprobs, src=last_stage, group=ps.get_pipeline_model_parallel_group())
        results.append(logprobs)
    return results

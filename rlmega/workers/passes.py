"""Running Megatron's pipeline schedule over a list of micro-batches with a per-micro-batch head.

A *head* turns the last stage's output for one micro-batch into ``(loss, metrics, outputs)``:
the loss to backpropagate (forward-only passes ignore it), token-weighted scalar metrics and
per-sequence tensors to hand back (log-probs, entropies, values). The schedule (1F1B, or
interleaved with virtual stages) runs the layers; this module only feeds it and collects.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlmega.parallel.cpu_platform import direct
from rlmega.workers.batching import MicroBatch, concatenated_ranges
from rlmega.workers.lm_head import response_logits_layer, set_rows

# (micro_batch, last-stage output [B, S, V_local or 1]) -> HeadResult
Head = Callable[[MicroBatch, torch.Tensor], "HeadResult"]


@dataclasses.dataclass
class HeadResult:
    loss: torch.Tensor
    """0-dim; what the backward pass differentiates (scaled as the caller needs)."""
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Scalar means over this micro-batch's response tokens (weighted by their count when combined)."""
    summed: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Scalars that add up over micro-batches and ranks (loss terms under global denominators)."""
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-token values ``[N]`` in the micro-batch's response order."""


def run_schedule(chunks: list, micro_batches: list[MicroBatch], head: Head, *, forward_only: bool,
                 routing=None) -> list[Optional[HeadResult]]:
    """One pass of Megatron's schedule; on the last pipeline stage, each micro-batch's head result
    (None elsewhere). Gradients accumulate into the DDP buffers when not ``forward_only``.
    ``routing`` (``rlmega.workers.routing.RoutingReplay``) records or replays the MoE routing."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        micro_batch = next(iterator)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        mask = micro_batch.attention_mask
        if routing is not None:
            routing.before(model, micro_batch)
        lm_head = response_logits_layer(model)
        if lm_head is not None:  # the output holds the response rows only, in order
            set_rows(lm_head, micro_batch.response_positions)
            head_batch = dataclasses.replace(micro_batch, response_positions=None)
        else:
            head_batch = micro_batch
        output = model(
            micro_batch.tokens.to(device), micro_batch.position_ids.to(device),
            _mask_on(mask, device), packed_seq_params=_on(micro_batch.packed_seq_params, device),
            **{name: value.to(device) for name, value in micro_batch.model_inputs().items()},
        )
        if routing is not None:
            routing.after(model, micro_batch)

        def loss_func(output_tensor):
            result = head(head_batch, output_tensor)
            # Megatron scales the returned loss in place; the result keeps its own reference.
            return result.loss.clone(), {"result": result}

        return output, loss_func

    shape = micro_batches[0].tokens.shape  # under context parallelism, this rank's share of the sequence
    # On CPU, after a first run under the platform's mode, without it (rlmega.parallel.cpu_platform.direct).
    with direct(chunks[0], ("schedule", forward_only, routing is not None)):
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=shape[1] * ps.get_context_parallel_world_size(), micro_batch_size=shape[0],
            forward_only=forward_only,
        )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return [None] * len(micro_batches)
    return [item["result"] for item in results]


def _mask_on(mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The attention mask on ``device``, with the segment lengths a packed row's mask carries
    (``models.attention_mask.block_causal_mask``): a moved tensor is a new object, without the attribute."""
    if mask is None or device is None:
        return mask
    moved = mask.to(device)
    if hasattr(mask, "segment_lengths"):
        moved.segment_lengths = mask.segment_lengths
    return moved


def _on(packed_seq_params, device):
    """THD parameters with their ``cu_seqlens`` tensors on ``device`` (transformer-engine reads them there)."""
    if packed_seq_params is None or device is None:
        return packed_seq_params
    moved = {field.name: getattr(packed_seq_params, field.name).to(device)
             for field in dataclasses.fields(packed_seq_params) if torch.is_tensor(getattr(packed_seq_params, field.name))}
    return dataclasses.replace(packed_seq_params, **moved)


def reporting_rank() -> bool:
    """One rank per data-parallel replica reports results: last pipeline stage, TP and CP rank 0
    (the heads gather context-parallel shares, so every CP rank has the whole results)."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def results_elsewhere() -> bool:
    """Whether some rank lacks results that another has, so that they must be summed over the default group:
    with several data-parallel replicas (each computes its own sequences) or pipeline stages (only the last
    computes them). Tensor- and context-parallel ranks of one replica all hold its whole results (the heads
    gather what those split), so with neither no collective is needed (each costs its latency)."""
    from megatron.core import parallel_state as ps

    return (dist.is_initialized() and dist.get_world_size() > 1 and (
        ps.get_data_parallel_world_size() > 1 or ps.get_pipeline_model_parallel_world_size() > 1))


def combine_metrics(results: list[Optional[HeadResult]], micro_batches: list[MicroBatch]) -> dict[str, float]:
    """The heads' metrics over every micro-batch of every data-parallel rank, the same on all ranks:
    token-weighted means of ``metrics``, totals of ``summed``. Collective over the default group where ranks hold
    different results (``results_elsewhere``)."""
    means, totals = _agree_on_names(
        {n for r in results if r is not None for n in r.metrics}, {n for r in results if r is not None for n in r.summed})
    sums = torch.zeros(len(means) + len(totals) + 1, dtype=torch.float64)
    elsewhere = results_elsewhere()
    if reporting_rank() or not elsewhere:
        for result, micro_batch in zip(results, micro_batches):
            weight = float(sum(micro_batch.response_lengths))  # all its tokens, also under context parallelism
            sums[-1] += weight
            for slot, name in enumerate(means):
                if name in result.metrics and weight:
                    sums[slot] += weight * float(result.metrics[name])
            for slot, name in enumerate(totals, start=len(means)):
                if name in result.summed:
                    sums[slot] += float(result.summed[name])
    if elsewhere:
        dist.all_reduce(sums)
    total_weight = max(float(sums[-1]), 1.0)
    combined = {name: float(sums[slot]) / total_weight for slot, name in enumerate(means)}
    combined.update({name: float(sums[slot]) for slot, name in enumerate(totals, start=len(means))})
    return combined


def _agree_on_names(means: set[str], totals: set[str]) -> tuple[list[str], list[str]]:
    """Every rank's names of mean and summed metrics (only the last stage knows them), sorted; one all-gather."""
    gathered: list = [(means, totals)]
    if results_elsewhere():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (means, totals))
    return sorted(set().union(*(part[0] for part in gathered))), sorted(set().union(*(part[1] for part in gathered)))


def scatter_outputs(
    results: list[Optional[HeadResult]], micro_batches: list[MicroBatch], name: str, response_lengths: list[int],
) -> list[torch.Tensor]:
    """Per-sequence ``name`` outputs of the whole batch on every rank.

    Each sequence is computed by exactly one data-parallel replica; its reporting rank writes it
    into a flat buffer and a sum over all ranks assembles the batch (collective), unless every rank
    already holds every result (``results_elsewhere``).
    """
    offsets = list(itertools.accumulate(response_lengths, initial=0))
    flat = torch.zeros(offsets[-1], dtype=torch.float32)
    elsewhere = results_elsewhere()
    if reporting_rank() or not elsewhere:
        for result, micro_batch in zip(results, micro_batches):
            slots = concatenated_ranges([offsets[index] for index in micro_batch.indices], micro_batch.response_lengths)
            flat[slots] = result.outputs[name].detach().float().cpu()
    if elsewhere:
        dist.all_reduce(flat)
    return [part.clone() for part in flat.split(response_lengths)]  # each its own storage, sent on its own

"""From a batch of variable-length sequences to the micro-batches one rank feeds Megatron.

Three steps, each a pure function of the sequence lengths (so every rank computes the same plan):

1. ``balance_across_ranks``: sequences go to data-parallel ranks by token count (longest first,
   each to the least-loaded rank), not by count, so no rank idles behind a long one.
2. ``split_by_token_budget``: a rank's sequences are split into micro-batches of at most
   ``max_tokens`` tokens each (a longer sequence sits alone); every rank uses the same number of
   micro-batches (pipeline schedules and expert all-to-alls run in lockstep), empty ones included.
3. ``build_micro_batch``: the tokens of one micro-batch, either packed into one row (no padding in
   the forward: the attention is block-diagonal, by THD cu_seqlens with transformer-engine or an
   explicit mask otherwise) or right-padded into ``[B, S]``.

A sequence is ``prompt + response``; the model is trained and scored only on response tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from typing import Optional

import torch

from rlmega.algos.distill import DistillConfig
from rlmega.algos.rollout_correction import RolloutCorrectionConfig
from rlmega.data.schema import ImageInputs
from rlmega.models.attention_mask import block_causal_mask
from rlmega.workers.packed import portable


@dataclasses.dataclass
class SequenceBatch:
    """Token sequences and per-response-token data (``fields[name][i]`` has one entry, or one row, per response
    token)."""

    tokens: list[torch.Tensor]
    """``[L_i]`` int64 token ids: the prompt followed by the response."""
    prompt_lengths: list[int]
    fields: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    """e.g. ``old_logp``, ``ref_logp``, ``advantages``, ``returns``, ``values``: ``[L_i - prompt_i]`` each;
    ``teacher_topk_ids`` / ``teacher_topk_logp``: ``[L_i - prompt_i, k]``."""
    temperature: float = 1.0
    """The sampling temperature of the responses: every log-prob and entropy of this batch is taken
    under ``softmax(logits / temperature)``, the distribution the engine sampled from (0: greedy, as 1)."""
    routing: Optional[list[torch.Tensor]] = None
    """MoE routing to replay (``rlmega.workers.routing``): per sequence ``[L_i, M, k]`` expert ids, every
    token through the model's M MoE layers; None: the routers choose."""
    images: Optional[list[Optional[ImageInputs]]] = None
    """A vision-language model's inputs: per sequence its images (None: text only); None: no sequence has any."""
    rollout_correction: Optional[RolloutCorrectionConfig] = None
    """Bypass mode (``algorithm.rollout_correction.bypass_mode``): the correction the policy loss applies on
    each micro-batch, the current policy against ``old_logp`` (there the engine's log-probs); None: none."""
    distill: Optional[DistillConfig] = None
    """On-policy distillation's top-k loss term (``algorithm.distill`` with ``estimator: top_k``), which the policy
    loss adds from fields ``teacher_topk_ids`` and ``teacher_topk_logp``; None: none."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if len(self.tokens) != len(self.prompt_lengths):
            raise ValueError(f"{len(self.tokens)} sequences but {len(self.prompt_lengths)} prompt lengths")
        for index, (tokens, prompt) in enumerate(zip(self.tokens, self.prompt_lengths)):
            if tokens.dim() != 1 or not 1 <= prompt < tokens.numel():
                raise ValueError(
                    f"sequence {index}: need 1-D tokens with a prompt of 1..{tokens.numel() - 1} tokens and at least "
                    f"one response token, got shape {list(tokens.shape)} and prompt length {prompt}"
                )
        if self.images is not None and len(self.images) != len(self.tokens):
            raise ValueError(f"images has {len(self.images)} entries for {len(self.tokens)} sequences")
        if self.routing is not None:
            if len(self.routing) != len(self.tokens):
                raise ValueError(f"routing has {len(self.routing)} entries for {len(self.tokens)} sequences")
            for index, (routing, tokens) in enumerate(zip(self.routing, self.tokens)):
                if routing.dim() != 3 or routing.shape[0] != tokens.numel():
                    raise ValueError(f"routing of sequence {index} has shape {list(routing.shape)}, expected "
                                     f"[{tokens.numel()}, moe_layers, topk] (one row per token)")
        response_lengths = self.response_lengths
        for name, values in self.fields.items():
            if len(values) != len(self.tokens):
                raise ValueError(f"field {name!r} has {len(values)} entries for {len(self.tokens)} sequences")
            for index, value in enumerate(values):
                if value.shape[:1] != (response_lengths[index],):
                    raise ValueError(
                        f"field {name!r} of sequence {index} has shape {list(value.shape)}, "
                        f"expected [{response_lengths[index]}, ...] (one value or row per response token)"
                    )

    def __reduce__(self):
        # Sent to every rank on every step: each list crosses as one tensor (rlmega.workers.packed).
        return (_rebuild_batch, (portable(self.tokens), self.prompt_lengths,
                                 {name: portable(values) for name, values in self.fields.items()}, self.temperature,
                                 portable(self.routing), self.images, self.rollout_correction, self.distill))

    def __len__(self) -> int:
        return len(self.tokens)

    # Read many times per step, a torch call per sequence each: worked out once (a batch's sequences never change).
    @functools.cached_property
    def lengths(self) -> list[int]:
        return [tokens.numel() for tokens in self.tokens]

    @functools.cached_property
    def response_lengths(self) -> list[int]:
        return [length - prompt for length, prompt in zip(self.lengths, self.prompt_lengths)]

    def select(self, indices: list[int]) -> "SequenceBatch":
        return SequenceBatch(
            [self.tokens[i] for i in indices], [self.prompt_lengths[i] for i in indices],
            {name: [values[i] for i in indices] for name, values in self.fields.items()}, self.temperature,
            None if self.routing is None else [self.routing[i] for i in indices],
            None if self.images is None else [self.images[i] for i in indices], self.rollout_correction, self.distill,
        )

    def with_fields(self, **fields: list[torch.Tensor]) -> "SequenceBatch":
        return dataclasses.replace(self, fields={**self.fields, **fields})

    @property
    def logit_scale(self) -> float:
        """What the logits are divided by before a log-softmax (greedy decoding scores the raw logits)."""
        return self.temperature if self.temperature > 0 else 1.0


def _rebuild_batch(tokens, prompt_lengths, fields, temperature, routing, images, rollout_correction,
                   distill) -> SequenceBatch:
    return SequenceBatch(tokens, prompt_lengths, fields, temperature, routing, images, rollout_correction, distill)


def reading_at(batch: SequenceBatch, positions: list[int]) -> SequenceBatch:
    """A batch on which the heads read one output per sequence, at ``positions[i]`` of sequence i.

    The heads read the outputs at the positions that predict response tokens. Sequence i becomes
    its tokens up to ``positions[i]`` and one placeholder token as the whole response, so that
    position is its only one; under causal attention its output is the one in the whole sequence
    (the cut tokens come after it, the placeholder only sees it). Fields and prompts are dropped.
    """
    tokens = [torch.cat([seq[:at + 1], seq[at:at + 1]]) for seq, at in zip(batch.tokens, positions)]
    return SequenceBatch(tokens, [at + 1 for at in positions])


def balance_across_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Indices of the sequences each rank gets, balancing token counts (longest-first greedy).

    Deterministic; within a rank, indices are in ascending order.
    """
    loads = [(0, rank) for rank in range(num_ranks)]
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(loads)
        assignment[rank].append(index)
        heapq.heappush(loads, (load + lengths[index], rank))
    return [sorted(indices) for indices in assignment]


def count_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` tokens first-fit-decreasing needs."""
    bins: list[int] = []
    for length in sorted(lengths, reverse=True):
        for slot, used in enumerate(bins):
            if used + length <= max_tokens:
                bins[slot] += length
                break
        else:
            bins.append(length)
    return len(bins)


def split_by_token_budget(indices: list[int], lengths: list[int], num_micro_batches: int) -> list[list[int]]:
    """Split ``indices`` into exactly ``num_micro_batches`` groups with balanced token counts.

    Groups may be empty when there are fewer sequences than micro-batches. Each group keeps the
    original order of its indices.
    """
    loads = [(0, slot) for slot in range(num_micro_batches)]
    groups: list[list[int]] = [[] for _ in range(num_micro_batches)]
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        load, slot = heapq.heappop(loads)
        groups[slot].append(index)
        heapq.heappush(loads, (load + lengths[index], slot))
    return [sorted(group) for group in groups]


@dataclasses.dataclass
class MicroBatch:
    """Model inputs of one micro-batch and where its response tokens sit in the output."""

    indices: list[int]
    """Which sequences of the (mini-)batch this holds, in order."""
    tokens: torch.Tensor
    """``[B, S]`` (``B = 1`` when packed)."""
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    """``[1, 1, S, S]`` bool, True where attention is forbidden (packed rows without transformer-engine); else None."""
    packed_seq_params: Optional[object]
    """Megatron ``PackedSeqParams`` (THD) when packed with transformer-engine; else None."""
    response_positions: Optional[torch.Tensor]
    """``[N]`` flat indices into ``B * S`` of the positions whose next-token prediction is a response token;
    None in the micro-batch a head gets when the output holds exactly those rows, in order
    (``rlmega.workers.lm_head``)."""
    response_targets: torch.Tensor
    """``[N]`` the response tokens predicted there."""
    response_lengths: list[int]
    """Response tokens per sequence; ``response_positions`` lists them sequence by sequence."""
    context_share: Optional[object] = None
    """Under context parallelism, this rank's share (``context_parallel.ContextShare``): then
    ``tokens`` and ``response_*`` positions are this rank's, ``response_lengths`` the whole sequences'."""
    placements: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """Per sequence, its first token's flat index into the whole (unsplit) ``[B, S]`` and its length."""
    routing: Optional[torch.Tensor] = None
    """``[B, S, M, k]`` MoE routing laid out like ``tokens`` (-1 on padding), when the batch has routing
    to replay."""
    pixel_values: Optional[torch.Tensor] = None
    """A vision-language model's: the images of the micro-batch's sequences, in their order (None: none)."""
    image_grid_thw: Optional[torch.Tensor] = None
    image_mask: Optional[torch.Tensor] = None
    """``[B, S]`` where the image features go: the image-pad tokens of the prompts (not of responses)."""

    def model_inputs(self) -> dict:
        """Keyword inputs of the model beyond tokens, positions and mask (the images, if any)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "image_mask": self.image_mask}

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def row_multiple(tp: int, sequence_parallel: bool, cp: int) -> int:
    """What a row's length must be a multiple of: sequence parallelism splits a rank's tokens over
    ``tp`` ranks, context parallelism a row into ``2 * cp`` chunks."""
    return (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def concatenated_ranges(starts: list[int], counts: list[int]) -> torch.Tensor:
    """``cat([arange(start, start + count) for ...])`` in a handful of tensor ops, not one per range: a batch
    has hundreds of sequences, and each op costs more than the arithmetic."""
    counts_t = torch.tensor(counts, dtype=torch.long)
    first = torch.tensor(starts, dtype=torch.long) - (torch.cumsum(counts_t, 0) - counts_t)
    return torch.arange(int(sum(counts))) + torch.repeat_interleave(first, counts_t)


PACKING_PAYS_ABOVE = 1.1
"""Padding waste (padded tokens / real tokens) above which a micro-batch is packed, where packing means a block-causal
mask (attention without transformer-engine's THD kernel: CPU). Attending a packed row segment by segment gathers
queries, keys and values into a padded layout and back, which on the tiny CPU job cost about 10 % of the update
more than right-padding sequences of equal length: nearly equal lengths pad."""


def packs_better(lengths: list[int], row_multiple: int = 1) -> bool:
    """Whether sequences of ``lengths`` are better packed into one row than right-padded, when the packed row needs a
    block-causal mask (see ``PACKING_PAYS_ABOVE``); ``row_multiple``: what a padded row's length rounds up to."""
    padded = len(lengths) * _round_up(max(lengths, default=1), row_multiple)
    return padded > PACKING_PAYS_ABOVE * max(sum(lengths), 1)


def build_micro_batch(
    batch: SequenceBatch, indices: list[int], *, packing: bool, pad_to_multiple: int = 1,
    shape: Optional[tuple[int, int]] = None, use_thd: bool = False, pad_token_id: int = 0,
    segment_multiple: int = 1, vision=None,
) -> MicroBatch:
    """The inputs of the micro-batch made of ``batch``'s sequences ``indices`` (may be empty).

    ``pad_to_multiple`` rounds the row length up (sequence parallelism needs a multiple of tp).
    ``shape`` forces ``[B, S]`` (pipeline stages exchange fixed-shape activations), padding with
    rows of pad tokens that carry no response tokens. ``segment_multiple`` gives each packed
    sequence a slot of a multiple of that many tokens (THD context parallelism splits every
    sequence into ``2 * cp`` equal chunks). ``vision`` (a vision-language model's ``VisionSpec``):
    ``position_ids`` are ``[3, B, S]`` multimodal positions and the sequences' images come along.
    """
    sequences = [batch.tokens[i] for i in indices]
    prompts = [batch.prompt_lengths[i] for i in indices]
    slots = [_round_up(s.numel(), segment_multiple) if packing else s.numel() for s in sequences]
    if packing:
        length = _round_up(max(sum(slots), 1), pad_to_multiple)
        rows, width = 1, length if shape is None else max(length, shape[1])
    else:
        length = _round_up(max(slots, default=1), pad_to_multiple)
        rows, width = max(len(sequences), 1), length
        if shape is not None:
            rows, width = max(rows, shape[0]), max(width, shape[1])
    tokens = torch.full((rows, width), pad_token_id, dtype=torch.long)
    position_ids = torch.arange(width).repeat(rows, 1)
    lengths = [batch.lengths[i] for i in indices]
    responses = [length - prompt for length, prompt in zip(lengths, prompts)]
    if packing:
        starts = [0, *itertools.accumulate(slots[:-1])]
    else:
        starts = [row * width for row in range(len(sequences))]
    offset = sum(slots) if packing else 0
    real_lengths, slot_lengths = (list(lengths), list(slots)) if packing else ([], [])  # packed segments
    placements = list(zip(starts, lengths))
    positions = targets = torch.zeros(0, dtype=torch.long)
    if sequences:
        concatenated = torch.cat(sequences)
        tokens.view(-1)[concatenated_ranges(starts, lengths)] = concatenated
        if packing:  # positions count from 0 in every slot
            position_ids[0, :offset] = concatenated_ranges([0] * len(slots), slots)
        # The positions that predict the response tokens (from each prompt's last token on), and those tokens.
        positions = concatenated_ranges([start + prompt - 1 for start, prompt in zip(starts, prompts)], responses)
        first = [0, *itertools.accumulate(lengths[:-1])]  # each sequence's start in the concatenation
        targets = concatenated[concatenated_ranges([at + prompt for at, prompt in zip(first, prompts)], responses)]
    images = {}
    if vision is not None:
        position_ids, images = _multimodal_inputs(batch, indices, placements, position_ids, vision)
    attention_mask = packed_seq_params = None
    if packing:
        if width > offset:  # the padding tail attends only to itself
            real_lengths.append(width - offset)
            slot_lengths.append(width - offset)
        if use_thd:
            packed_seq_params = _thd_params(real_lengths, slot_lengths, padded_slots=segment_multiple > 1)
        else:  # a slot's padding is a segment of its own
            pieces = [n for real, slot in zip(real_lengths, slot_lengths) for n in (real, slot - real) if n]
            attention_mask = block_causal_mask(pieces)
    return MicroBatch(
        indices=list(indices), tokens=tokens, position_ids=position_ids, attention_mask=attention_mask,
        packed_seq_params=packed_seq_params,
        response_positions=positions, response_targets=targets, response_lengths=responses,
        placements=placements,
        routing=None if batch.routing is None else _routing_rows(batch, indices, placements, rows, width),
        **images,
    )


def _multimodal_inputs(batch: SequenceBatch, indices: list[int], placements: list[tuple[int, int]],
                       position_ids: torch.Tensor, vision) -> tuple[torch.Tensor, dict]:
    """``[3, B, S]`` positions (each sequence's multimodal ones in its place, padding counting up on all three
    axes) and the micro-batch's images in sequence order."""
    from rlmega.models.vision_language import image_token_mask, mrope_positions

    multimodal = position_ids.unsqueeze(0).repeat(3, 1, 1)
    flat = multimodal.view(3, -1)
    mask = torch.zeros(position_ids.shape, dtype=torch.bool)
    pixels, grids = [], []
    for index, (start, length) in zip(indices, placements):
        images = batch.images[index] if batch.images is not None else None
        grid = images.grid_thw if images is not None else None
        prompt = batch.prompt_lengths[index]
        flat[:, start:start + length] = mrope_positions(batch.tokens[index], grid, vision, prompt)
        if images is not None:
            mask.view(-1)[start:start + length] = image_token_mask(batch.tokens[index], vision, prompt)
            pixels.append(images.pixel_values)
            grids.append(images.grid_thw)
    if not pixels:
        return multimodal, {}
    return multimodal, {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids), "image_mask": mask}


def _routing_rows(batch: SequenceBatch, indices: list[int], placements: list[tuple[int, int]], rows: int,
                  width: int) -> torch.Tensor:
    """``[rows, width, M, k]``: each sequence's routing where its tokens are; padding -1 (the replay routes
    it to experts 0..k-1 and leaves it out of its counts)."""
    layers, topk = batch.routing[indices[0]].shape[1:] if indices else batch.routing[0].shape[1:]
    routing = torch.full((rows * width, layers, topk), -1, dtype=torch.int16)
    for index, (start, length) in zip(indices, placements):
        routing[start:start + length] = batch.routing[index]
    return routing.view(rows, width, layers, topk)


def _thd_params(real_lengths: list[int], slot_lengths: list[int], padded_slots: bool):
    """Megatron's ``PackedSeqParams`` for a packed row (transformer-engine's THD attention), with
    the slots' padded offsets when sequences sit in padded slots (context parallelism)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def cumulative(lengths):
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), dim=0)
        return cu_seqlens

    padded = cumulative(slot_lengths) if padded_slots else None
    longest = max(slot_lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cumulative(real_lengths), cu_seqlens_kv=cumulative(real_lengths),
        cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest,
    )


def padding_mask(lengths: list[int]) -> torch.Tensor:
    """``[B, max(lengths)]`` bool, True at the first ``lengths[i]`` entries of row i."""
    return torch.arange(max(lengths, default=0)).unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).unsqueeze(1)


def padded_field(values: list[torch.Tensor], dtype=torch.float32,
                 lengths: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, R_max]`` right-padded values and the ``[B, R_max]`` bool mask of real entries (``lengths``: the
    values' lengths, when the caller knows them)."""
    mask = padding_mask([value.numel() for value in values] if lengths is None else lengths)
    padded = torch.zeros(mask.shape, dtype=dtype)
    if values:
        padded[mask] = torch.cat(values).to(dtype)
    return padded, mask


def split_padded(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-token values ``[N]`` listed sequence by sequence -> ``[B, R_max]`` right-padded (differentiable)."""
    mask = padding_mask(lengths).to(flat.device)
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)

"""Sequence classification (HF ``*ForSequenceClassification``, the discriminative reward models) on
Megatron's GPTModel.

Such a checkpoint is a causal LM's trunk with a ``score`` head, ``score.weight`` ``[num_labels, hidden]``
(no bias, no vocabulary), in place of the LM head. ``ScoreHead`` takes the GPTModel's output-layer
place, so the model's forward gives per-token scores ``[B, S, num_labels]``; a sequence's score is
the one at the token ``score_position`` picks, as transformers picks it.

Under tensor parallelism every rank holds the whole head (replicated, not column-parallel):
``num_labels`` is 1 for reward models, which cannot be split over TP ranks; the head is only
``num_labels * hidden`` numbers, so computing all of it on every rank costs nothing, and every TP
rank then has the whole scores without an all-gather over the label dimension. The bridge maps it
as a plain copy (no vocabulary padding: the output size is ``num_labels``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True)
class ScoreHeadSpec:
    """The ``score`` head of an HF sequence-classification checkpoint."""

    num_labels: int
    """Output size of the head (1 for a reward model)."""
    pad_token_id: Optional[int]
    """The config's pad token: a sequence's score is read at its last token that is not this one;
    None: at its last token."""


def score_head_from_hf(hf: dict[str, Any]) -> ScoreHeadSpec:
    """``num_labels`` as transformers reads it: the size of ``id2label`` (``save_pretrained`` writes
    that, not ``num_labels``), else ``num_labels``, else transformers' default of 2."""
    labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels") or 2
    return ScoreHeadSpec(num_labels=int(labels), pad_token_id=hf.get("pad_token_id"))


def score_position(tokens: torch.Tensor, pad_token_id: Optional[int]) -> int:
    """Where transformers' ``*ForSequenceClassification`` reads the score of ``tokens`` ``[L]``: the
    last position whose token is not ``pad_token_id`` (0 if every token is), or the last position
    when there is no pad token (transformers' rule for a batch of one, the only batch it accepts then).

    Any padding of a batch adds only pad tokens, so this is transformers' choice on every row of a
    right- or left-padded batch too.
    """
    if pad_token_id is None:
        return tokens.numel() - 1
    real = torch.nonzero(tokens != pad_token_id).flatten()
    return int(real[-1]) if real.numel() else 0


class ScoreHead(torch.nn.Module):
    """Hidden states ``[S, B, H]`` -> scores ``[S, B, num_labels]``, in the output layer's place (the
    same call signature as Megatron's ``ColumnParallelLinear``). A reward model's weight is HF's
    ``score``; the critic's value head (``rlmega.workers.model.value_head``) is a one-label ScoreHead too.

    With sequence parallelism each TP rank holds a slice of the sequence: it scores its slice and the
    scores (``num_labels`` per token, not ``hidden``) are gathered. The backward splits the scores'
    gradient back (every TP rank computes the same loss from the whole scores), and the weight's
    gradient, from a slice, is summed over TP ranks like a layer norm's (``sequence_parallel``).
    """

    def __init__(self, config, num_labels: int):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(num_labels, config.hidden_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:  # replicated, like Megatron's router: the same RNG on every TP rank
            config.init_method(self.weight)
        self.sequence_parallel = config.sequence_parallel
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        scores = torch.nn.functional.linear(hidden_states, self.weight)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            scores = gather_from_sequence_parallel_region(scores, tensor_parallel_output_grad=False)
        return scores, None


def attach_score_head(model: torch.nn.Module, spec: ScoreHeadSpec, config) -> None:
    """Replace a GPTModel chunk's LM head by the score head (on the last pipeline stage, which has one).

    GPTModel always builds its vocabulary-sized output layer; it lives only until this replaces it."""
    if model.post_process:
        model.output_layer = ScoreHead(config, spec.num_labels)

"""The LM head computes logits only where the heads read them.

Megatron's output layer turns every position's hidden state into logits over this rank's slice of
the padded vocabulary, ``[S, B, V_pad / tp]``. rlmega's heads (log-probs, the policy and SFT
losses) read only the rows that predict a response token, and only the columns of real tokens.
In RL the prompt positions are often half of each sequence or more, and the vocabulary is padded to
a multiple of 1024 so that a checkpoint loads at any tp <= 8 (the quickstart's 104 tokens become
1024 columns). While a micro-batch's response positions are set (``set_rows``), the output layer
computes ``[N, 1, V_real_local]``: the ``N`` response rows, in order, and this rank's real columns
(none on a rank whose slice is all padding). The values equal those entries of the full logits, and
so does the gradient (the heads give the other entries none).

The layer stays Megatron's ``ColumnParallelLinear`` (its parameter, its attributes and its
checkpoint layout); only ``forward`` differs while rows are set, built from Megatron's public
tensor-parallel mappings: the sequence-parallel all-gather (reduce-scatter of the gradient) or the
TP copy (all-reduce of the gradient), as ``ColumnParallelLinear`` does.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.cache
def _response_logits_class():
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear, copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
        linear_with_grad_accumulation_and_async_allreduce,
    )

    class ResponseLogits(ColumnParallelLinear):
        """``ColumnParallelLinear`` that, while ``rows`` is set, computes only those rows and the real columns."""

        rows: Optional[torch.Tensor] = None
        real_columns: int = 0

        def forward(self, input_, weight=None, runtime_gather_output=None):
            rows, self.rows = self.rows, None  # one output-layer call per micro-batch
            if rows is None:
                return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            if runtime_gather_output:
                raise ValueError("response-row logits stay split over the vocabulary; runtime_gather_output "
                                 "is not supported with them")
            weight = self.weight if weight is None else weight
            if self.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                              group=self.tp_group)
            elif self.tp_group is not None and self.tp_group.size() > 1:
                hidden = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            else:
                hidden = input_
            length, width, size = hidden.shape
            # rows index the output as [B, S] (Megatron returns it batch-first); the hidden states are [S, B, H].
            rows = rows.to(hidden.device)
            selected = hidden.reshape(length * width, size).index_select(0, (rows % length) * width + rows // length)
            # Megatron's fused weight-gradient kernel (GPU) accumulates into the parameter's main_grad, so it gets
            # the whole parameter and the padding columns are dropped after; otherwise they are never computed.
            fused = self.gradient_accumulation_fusion
            logits = linear_with_grad_accumulation_and_async_allreduce(
                selected.unsqueeze(1), weight if fused else weight[: self.real_columns], None,
                gradient_accumulation_fusion=fused, allreduce_dgrad=False, sequence_parallel=False,
                tp_group=self.tp_group)  # the input's TP communication is done above
            return (logits[..., : self.real_columns] if fused else logits), None

    return ResponseLogits


def install(model, vocab_size: int) -> bool:
    """Let ``model``'s output layer (a Megatron GPTModel chunk on the last stage) compute response rows only;
    whether it can: not for models with MTP layers (their output layer serves those too), a biased or
    gathering output layer, deferred embedding weight gradients (Megatron keeps the layer's inputs for
    them), or a replaced one (the critic's and the reward model's score heads)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if (type(layer) is not ColumnParallelLinear or layer.bias is not None or layer.gather_output
            or getattr(model.config, "mtp_num_layers", None) or layer.config.defer_embedding_wgrad_compute):
        return False
    rank = layer.tp_group.rank() if layer.tp_group is not None else 0
    width = layer.output_size_per_partition
    layer.__class__ = _response_logits_class()  # the same module, parameters and checkpoint layout; a new forward
    layer.real_columns = max(0, min(width, vocab_size - rank * width))
    return True


def response_logits_layer(chunk):
    """The output layer of a (wrapped) model chunk if ``install`` took on it, else None."""
    while not hasattr(chunk, "output_layer") and hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    layer = getattr(chunk, "output_layer", None)
    return layer if isinstance(layer, _response_logits_class()) else None


def set_rows(layer, rows: torch.Tensor) -> None:
    """The next forward of ``layer`` computes the output rows ``rows`` (flat indices into ``[B, S]``) only."""
    layer.rows = rows

"""The experts a transformers MoE model routes every token to while the hf engine generates.

transformers' MoE blocks (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) call a ``gate`` module that
returns ``(router_logits, weights, expert_indices)``; a forward hook on each MoE layer's gate
reads the indices, ``[rows * positions, k]`` for the tokens of that forward call. The prefill
call sees the left-padded prompts, each decoding step one new token per row, so a row's routing
is its prompt's positions of the prefill followed by one entry per decoding step. The last
response token is sampled, never fed back, so it has no routing of its own: it repeats the one
before (its output predicts nothing the trainer scores).
"""

from __future__ import annotations

from typing import Optional

import torch


def moe_gates(model) -> list[torch.nn.Module]:
    """The gate modules of the decoder's MoE layers, in layer order."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    return [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "gate")
            and hasattr(getattr(layer.mlp, "gate"), "weight") and hasattr(layer.mlp, "experts")]


class RoutingRecorder:
    """Records each forward call's expert indices while active (``with recorder:``)."""

    def __init__(self, model):
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("routing is recorded for MoE models; this model has no MoE layers")
        self.calls: list[list[torch.Tensor]] = []  # per forward call, per layer: [rows * positions, k]
        self._pending: list[torch.Tensor] = []
        self._handles = []

    def __enter__(self) -> "RoutingRecorder":
        self.calls, self._pending = [], []
        for gate in self.gates:
            self._handles.append(gate.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module, inputs, output) -> None:
        indices = output[2] if isinstance(output, tuple) and len(output) == 3 else None
        if indices is None:
            raise RuntimeError(f"{type(module).__name__} does not return (logits, weights, indices); "
                               "routing cannot be recorded for this model")
        self._pending.append(indices.detach().to("cpu", torch.int16))
        if len(self._pending) == len(self.gates):
            self.calls.append(self._pending)
            self._pending = []

    def row_routing(self, rows: int, prompt_lengths: list[int], response_lengths: list[int]) -> list[torch.Tensor]:
        """Per row, ``[P + R, M, k]``: the prompt's tokens, then the response's (the last repeated)."""
        prefill = [layer.view(rows, -1, layer.shape[-1]) for layer in self.calls[0]]
        steps = [[layer.view(rows, layer.shape[-1]) for layer in call] for call in self.calls[1:]]
        result = []
        for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
            parts = [torch.stack([layer[row, -prompt:] for layer in prefill], dim=1)]  # [P, M, k]
            for step in steps[:max(response - 1, 0)]:
                parts.append(torch.stack([layer[row] for layer in step], dim=0)[None])
            routing = torch.cat(parts)
            result.append(torch.cat([routing, routing[-1:]]))  # the last token: no routing of its own
        return result


def routing_or_none(recorder: Optional[RoutingRecorder], rows: int, prompt_lengths: list[int],
                    response_lengths: list[int]) -> list[Optional[torch.Tensor]]:
    if recorder is None or not recorder.calls:
        return [None] * rows
    return recorder.row_routing(rows, prompt_lengths, response_lengths)

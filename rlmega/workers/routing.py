"""MoE routing replay: the experts every token was routed to, recorded once and forced later.

A MoE policy's routing is discontinuous: a tiny weight change (or the engine's other kernels) flips
a token's top-k experts, and the update then optimises a different network from the one that
produced the samples. Replay keeps the routing fixed (Megatron-Core's ``RouterReplay``; the
gate weights are still computed from the current router at the replayed experts):

- ``r2``: the actor's old-log-prob pass records the routing, and the update replays it, so every
  mini-batch and epoch trains through the routing of the policy that scored the batch.
- ``r3``: the rollout engine's routing (``SequenceBatch.routing``) is replayed in the old-log-prob
  pass and the update (needs an engine that reports routed experts).

Layouts. A batch's routing is, per sequence, ``[L_i, M, k]`` (every token, the model's M MoE
decoder layers in order, top-k expert ids). ``build_micro_batch`` lays it out like the tokens,
``[B, S, M, k]``, and context parallelism splits it like them. Inside the model a router sees its
rank's tokens sequence-major (``[S * B]`` rows), and under sequence parallelism only its tensor
rank's slice of S. Recording inverts the same steps.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rlmega.workers.batching import MicroBatch, SequenceBatch

REPLAY_MODES = ("none", "r2", "r3")


def moe_layer_numbers(spec) -> list[int]:
    """The 1-based decoder layer numbers of the model's MoE layers, in order."""
    layers = spec.config["num_layers"]
    pattern = spec.config.get("moe_layer_freq")
    if isinstance(pattern, list):
        return [index + 1 for index, is_moe in enumerate(pattern) if is_moe]
    return list(range(1, layers + 1)) if spec.num_experts else []


def decoder_routers(chunk, moe_layers: list[int]) -> list[tuple[int, object]]:
    """``(MoE layer index, router)`` for the decoder MoE layers of one model chunk (MTP layers keep
    their own routing). Each router's replay becomes ``backward_aware_replay_class()``'s."""
    from megatron.core.transformer.moe.router import TopKRouter

    index_of = {number: index for index, number in enumerate(moe_layers)}
    found = []
    for name, module in chunk.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}." and "decoder.layers." in name:
            if module.router_replay is None:
                raise RuntimeError("routing replay needs the model built with moe_enable_routing_replay")
            module.router_replay = _backward_aware(module.router_replay)
            found.append((index_of[module.layer_number], module))
    return found


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed layer being recomputed).
    ``torch._C._current_autograd_node`` is the node being executed (None outside backward); present
    in every torch rlmega supports (2.x), checked here rather than assumed."""
    current = getattr(torch._C, "_current_autograd_node", None)
    if current is None:
        raise RuntimeError("this torch has no torch._C._current_autograd_node: routing replay cannot tell a "
                           "recomputation from a forward pass")
    return current() is not None


_BACKWARD_AWARE: Optional[type] = None


def backward_aware_replay_class() -> type:
    """Megatron's ``RouterReplay`` that picks its mode per call: a forward pass replays the targets set
    for the current micro-batch; a layer recomputed in the backward pass (full recomputation) takes
    the oldest targets not yet recomputed, because Megatron's schedules run the backward passes of a
    chunk's micro-batches in the order of their forward passes, while later micro-batches' targets
    may already be set (pipeline parallelism). Built on first use (it subclasses a Megatron class)."""
    global _BACKWARD_AWARE
    if _BACKWARD_AWARE is not None:
        return _BACKWARD_AWARE
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class BackwardAwareReplay(RouterReplay):
        """Also counts, per forward pass, the real tokens whose own top-k set differs from the replayed one."""

        valid_rows: Optional[torch.Tensor] = None
        differing = counted = 0

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                if _in_backward():
                    top_indices = self.replay_backward_list.pop(0).to(scores.device)
                else:
                    top_indices = self.target_topk_idx.to(scores.device)
                    with torch.no_grad():
                        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                        differs = (own.sort(dim=1).values != top_indices.sort(dim=1).values).any(dim=1)
                        valid = self.valid_rows.to(differs.device)
                        self.differing += int((differs & valid).sum())
                        self.counted += int(valid.sum())
                return scores.gather(1, top_indices), top_indices
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    _BACKWARD_AWARE = BackwardAwareReplay
    return BackwardAwareReplay


def _backward_aware(original):
    """``original`` (a router's ``RouterReplay``) as a ``backward_aware_replay_class()`` instance, in its place
    in Megatron's registry of instances."""
    cls = backward_aware_replay_class()
    if isinstance(original, cls):
        return original
    replay = cls.__new__(cls)
    replay.__dict__.update(original.__dict__)
    registry = type(original).global_router_replay_instances
    registry[:] = [replay if item is original else item for item in registry]
    return replay


class RoutingReplay:
    """Record or replay the routing of one pass of the schedule over ``micro_batches``.

    ``before(chunk, micro_batch)`` and ``after(chunk, micro_batch)`` run around every chunk's
    forward call; ``recorded(batch)`` assembles what a recording pass saw, per sequence."""

    def __init__(self, chunks: list, spec, micro_batches: list[MicroBatch], *, record: bool, sequence_parallel: bool):
        self.record = record
        self.sequence_parallel = sequence_parallel
        self.moe_layers = moe_layer_numbers(spec)
        self.topk = spec.config["moe_router_topk"]
        self.routers = {id(chunk): decoder_routers(chunk, self.moe_layers) for chunk in chunks}
        self.position = {id(micro_batch): index for index, micro_batch in enumerate(micro_batches)}
        self.micro_batches = micro_batches
        self.seen: dict[tuple[int, int], torch.Tensor] = {}
        if not record and any(micro_batch.routing is None for micro_batch in micro_batches):
            raise ValueError("routing replay needs the batch's routing (SequenceBatch.routing)")

    def before(self, chunk, micro_batch: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self.routers.get(_unwrapped_id(chunk, self.routers), []):
            replay = router.router_replay
            if self.record:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                targets = self._local_rows(micro_batch.routing[:, :, layer])
                replay.valid_rows = targets[:, 0] >= 0  # padding (-1) goes to experts 0..k-1, uncounted
                arange = torch.arange(targets.shape[1], device=targets.device).expand_as(targets)
                replay.set_target_indices(torch.where(targets >= 0, targets, arange))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after(self, chunk, micro_batch: MicroBatch) -> None:
        if not self.record:
            return
        for layer, router in self.routers.get(_unwrapped_id(chunk, self.routers), []):
            self.seen[(self.position[id(micro_batch)], layer)] = router.router_replay.get_recorded_indices().detach().cpu()

    def finish(self) -> None:
        """Leave every router routing by itself again."""
        for routers in self.routers.values():
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def differing_fraction(self, name: str) -> dict[str, float]:
        """Of the real tokens this pass replayed, the fraction whose own top-k set (the router's choice,
        before replay) differs from the replayed one: ``routing/<name>`` over all MoE layers and
        ``routing/<name>/layer_<i>`` per layer. Collective over the world; resets the counts."""
        from megatron.core import parallel_state as ps

        counts = torch.zeros(len(self.moe_layers), 2, dtype=torch.float64)
        # Without sequence parallelism the tensor ranks route the same tokens: count them once.
        counting = self.sequence_parallel or ps.get_tensor_model_parallel_rank() == 0
        for routers in self.routers.values():
            for layer, router in routers:
                replay = router.router_replay
                if counting:
                    counts[layer] += torch.tensor([replay.differing, replay.counted], dtype=torch.float64)
                replay.differing = replay.counted = 0
        if dist.is_initialized():
            dist.all_reduce(counts)
        metrics = {f"routing/{name}/layer_{layer}": float(d / c) for layer, (d, c) in enumerate(counts.tolist()) if c}
        total = counts.sum(dim=0)
        if total[1]:
            metrics[f"routing/{name}"] = float(total[0] / total[1])
        return metrics

    def _local_rows(self, routing: torch.Tensor) -> torch.Tensor:
        """``[B, S, k]`` (this CP rank's tokens) -> the router's ``[S_local * B, k]`` rows."""
        rows = routing.transpose(0, 1)
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            rows = rows.chunk(tp, dim=0)[rank]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return rows.reshape(-1, rows.shape[-1]).long().to(device)

    def recorded(self, num_sequences: int) -> list[Optional[torch.Tensor]]:
        """Per sequence of the batch, ``[L_i, M, k]`` int16 routing of this rank's pipeline stage's MoE
        layers (other layers zero), gathered over the tensor-, context- and data-parallel ranks;
        collective over the world."""
        from megatron.core import parallel_state as ps

        pieces: dict[int, dict[int, torch.Tensor]] = {}  # sequence -> layer -> [L_i, k]
        for (position, layer), local in sorted(self.seen.items()):
            micro_batch = self.micro_batches[position]
            full = self._whole_micro_batch(local, micro_batch)  # [B, S, k]
            for sequence, (start, length) in zip(micro_batch.indices, micro_batch.placements):
                pieces.setdefault(sequence, {})[layer] = full.reshape(-1, self.topk)[start:start + length]
        # The tensor and context ranks now hold the same pieces; data ranks hold other sequences and
        # pipeline stages other layers. Everyone takes everyone's (a rank reads only its own layers).
        gathered = [None] * dist.get_world_size()
        share = pieces if ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0 else {}
        dist.all_gather_object(gathered, share)
        result: list[Optional[torch.Tensor]] = [None] * num_sequences
        for part in gathered:
            for sequence, layers in part.items():
                for layer, values in layers.items():
                    if result[sequence] is None:
                        result[sequence] = torch.zeros(values.shape[0], len(self.moe_layers), self.topk,
                                                       dtype=torch.int16)
                    result[sequence][:, layer] = values.to(torch.int16)
        return result

    def _whole_micro_batch(self, local: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
        """A router's recorded ``[S_local * B, k]`` -> ``[B, S, k]`` over the whole (unsplit) micro-batch."""
        from megatron.core import parallel_state as ps

        batch_rows = micro_batch.tokens.shape[0]
        rows = local.reshape(-1, batch_rows, self.topk)
        if self.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            rows = _all_gather(rows, ps.get_tensor_model_parallel_group())
        rows = rows.transpose(0, 1)  # [B, S_cp, k]
        share = micro_batch.context_share
        if share is None:
            return rows
        parts = _all_gather(rows.transpose(0, 1), ps.get_context_parallel_group(), concatenate=False)
        width = sum(columns.numel() for columns in share.columns)
        whole = torch.empty(batch_rows, width, self.topk, dtype=rows.dtype)
        for columns, part in zip(share.columns, parts):
            whole[:, columns] = part.transpose(0, 1)
        return whole


def _all_gather(tensor: torch.Tensor, group, concatenate: bool = True):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0) if concatenate else parts


def _unwrapped_id(chunk, known: dict) -> int:
    """The id under which ``chunk``'s routers were found (the schedule may pass the DDP wrapper or its module)."""
    while id(chunk) not in known and hasattr(chunk, "module"):
        chunk = chunk.module
    return id(chunk)


def routing_of(batch: SequenceBatch, recorded: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """The recorded routing as a batch field, refusing a sequence no rank recorded."""
    missing = [index for index, routing in enumerate(recorded) if routing is None]
    if missing:
        raise RuntimeError(f"routing replay: no routing was recorded for sequence {missing[0]} of the batch")
    for index, (routing, length) in enumerate(zip(recorded, batch.lengths)):
        if routing.shape[0] != length:
            raise RuntimeError(f"routing replay: sequence {index} has {length} tokens but {routing.shape[0]} routed")
    return recorded

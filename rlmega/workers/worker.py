"""The Megatron worker: one class for the actor, the reference, the critic, the reward model and a teacher,
chosen by config (``WorkerConfig.role`` names a ``rlmega.workers.roles.Role``, which says what differs).

Every rank of a layout holds one ``MegatronWorker`` and calls the same methods with the same
whole batch (a ``SequenceBatch``); each rank picks its data-parallel share itself, and results
come back whole on every rank. All methods are collective over the job's ranks.

    worker = MegatronWorker(spec, layout, WorkerConfig(role="actor"), hf_dir="ckpt/")
    old_logp, entropy = worker.compute_logprobs(batch)
    metrics = worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlmega.models import lora
from rlmega.models.reward_head import score_position
from rlmega.models.spec import ModelSpec, has_transformer_engine
from rlmega.parallel.cpu_platform import direct
from rlmega.parallel.layout import ParallelLayout
from rlmega.workers import checkpoint, heads
from rlmega.workers.batching import (
    MicroBatch, SequenceBatch, balance_across_ranks, build_micro_batch, count_micro_batches, packs_better, reading_at,
    row_multiple, split_by_token_budget,
)
from rlmega.workers.config import WorkerConfig
from rlmega.workers.context_parallel import split_micro_batch
from rlmega.workers.model import build_model, build_optimizer, resolve_dtype, use_fused_cpu_adam
from rlmega.workers.offload import HostOffload, TrainingState, model_tensors, optimizer_tensors
from rlmega.workers.optimizer_state import clear_moments
from rlmega.workers.passes import combine_metrics, run_schedule, scatter_outputs
from rlmega.workers.perf import PerfCounter
from rlmega.workers.roles import ROLES, Output
from rlmega.workers.top_k import scatter_top_k, top_k_head
from rlmega.workers.routing import RoutingReplay, routing_of


class MegatronWorker:
    def __init__(self, spec: ModelSpec, layout: ParallelLayout, config: WorkerConfig, *,
                 hf_dir: Optional[str | Path] = None, total_steps: int = 1):
        """Build this rank's model (and optimizer, for roles that train) in ``layout``; Megatron's
        process groups must exist (``rlmega.parallel.layout.initialize``). ``hf_dir`` loads HF
        weights through the bridge; ``total_steps`` is the default length of decaying LR schedules."""
        self.spec, self.layout, self.config = spec, layout, config
        self.role = ROLES[config.role]
        self.chunks, self.transformer_config = build_model(spec, layout, config)
        if hf_dir is not None:
            from rlmega.bridge import load_hf_weights

            with lora.adapters_disabled(self.chunks):  # the checkpoint holds the base weights
                load_hf_weights(self.chunks, spec, hf_dir, without_lm_head=not self.role.loads_lm_head)
        self.optimizer = self.scheduler = None
        if self.role.trains:
            self.optimizer, self.scheduler = build_optimizer(self.chunks, config.optimizer, resolve_dtype(config), total_steps)
        self.step = 0
        self.skipped_steps = 0
        self.base_folded = False
        """LoRA: whether adapters were folded into the base weights (``fold_adapters``), which then differ from the HF
        checkpoint's, so checkpoints keep the whole model and not the adapters alone."""
        self._perf = PerfCounter(self.chunks, spec)
        self._host = HostOffload()
        self._training_state = TrainingState()
        if config.offload:
            self.offload()

    # ---- forward passes -------------------------------------------------------------------

    def compute_logprobs(self, batch: SequenceBatch, *,
                         adapters: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence, the log-probs and entropies ``[R_i]`` of its response tokens (fp32), under
        the batch's sampling temperature (``softmax(logits / batch.temperature)``). ``adapters=False``: a LoRA
        actor's base model (its adapters off), which is the reference policy without a second model."""
        self.role.require("compute_logprobs")
        if not adapters and not self.config.lora.enabled:
            raise RuntimeError("compute_logprobs(adapters=False) needs a LoRA actor (actor.lora.rank > 0)")
        micro_batches = self._micro_batches(batch)
        head = heads.logprob_head(self.spec.vocab_size, self.config.batching.logprob_chunk_tokens, batch.logit_scale)
        # R2: the actor's old-log-prob pass records the routing its update will replay; R3 replays the engine's.
        record = adapters and self.role.records_routing and self.config.router_replay == "r2" and batch.routing is None
        routing = self._routing(micro_batches, record=record)
        base_model = contextlib.nullcontext() if adapters else lora.adapters_disabled(self.chunks)
        with self._on_device(), torch.no_grad(), base_model:
            try:
                results = run_schedule(self.chunks, micro_batches, head, forward_only=True, routing=routing)
            finally:
                if routing is not None:
                    routing.finish()
        if record:
            self._recorded_routing = (batch.tokens, routing_of(batch, routing.recorded(len(batch))))
        elif routing is not None and adapters:  # R3: how often the trainer chose other experts than the engine
            self._routing_metrics = routing.differing_fraction("rollout_differs")
        lengths = batch.response_lengths
        return (scatter_outputs(results, micro_batches, "logprobs", lengths),
                scatter_outputs(results, micro_batches, "entropy", lengths))

    def compute_top_k(self, batch: SequenceBatch, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence, the ``k`` most likely tokens at each of its response positions under the batch's sampling
        temperature: ids ``[R_i, k]`` (int64) and log-probs ``[R_i, k]`` (fp32), most likely first
        (``rlmega.workers.top_k``: from the vocabulary-parallel logits, never gathered)."""
        self.role.require("compute_top_k")
        micro_batches = self._micro_batches(batch)
        head = top_k_head(self.spec.vocab_size, k, self.config.batching.logprob_chunk_tokens, batch.logit_scale)
        with self._on_device(), torch.no_grad():
            results = run_schedule(self.chunks, micro_batches, head, forward_only=True)
        return scatter_top_k(results, micro_batches, batch.response_lengths, k)

    def _routing(self, micro_batches: list[MicroBatch], *, record: bool = False) -> Optional[RoutingReplay]:
        """What records or replays the MoE routing of a pass (None: the routers choose)."""
        if self.config.router_replay == "none" or not self.role.replays_routing:
            return None
        if not record and micro_batches and micro_batches[0].routing is None:
            if self.config.router_replay == "r3":
                raise RuntimeError("router_replay=r3: the batch carries no routing; the rollout engines must record "
                                   "it (rollout.backend=hf)")
            return None
        return RoutingReplay(self.chunks, self.spec, micro_batches, record=record,
                             sequence_parallel=self.transformer_config.sequence_parallel)

    def _with_recorded_routing(self, batch: SequenceBatch) -> SequenceBatch:
        """R2: ``batch`` with the routing the old-log-prob pass recorded for it."""
        if self.config.router_replay != "r2" or batch.routing is not None:
            return batch
        recorded = getattr(self, "_recorded_routing", None)
        if recorded is None or len(recorded[0]) != len(batch) or not all(
                torch.equal(a, b) for a, b in zip(recorded[0], batch.tokens)):
            raise RuntimeError("router_replay=r2: this batch's routing was not recorded; its old log-probs must come "
                               "from compute_logprobs on the same batch just before the update")
        return dataclasses.replace(batch, routing=recorded[1])

    def compute_values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per sequence, the critic's values ``[R_i]`` at the positions that predict response tokens."""
        self.role.require("compute_values")
        micro_batches = self._micro_batches(batch)
        with self._on_device(), torch.no_grad():
            results = run_schedule(self.chunks, micro_batches, heads.value_head(), forward_only=True)
        return scatter_outputs(results, micro_batches, "values", batch.response_lengths)

    def compute_scores(self, batch: SequenceBatch) -> torch.Tensor:
        """``[B]`` fp32: the reward model's score of each whole sequence (prompt and response), read
        where transformers' ``*ForSequenceClassification`` reads it: at the sequence's last token that
        is not the config's ``pad_token_id``, or at its last token when there is none
        (``rlmega.models.reward_head.score_position``). Prompt lengths, fields and temperature are
        not used."""
        self.role.require("compute_scores")
        pad_token_id = self.spec.score_head.pad_token_id
        scoring = reading_at(batch, [score_position(tokens, pad_token_id) for tokens in batch.tokens])
        micro_batches = self._micro_batches(scoring)
        # The score head's output at each sequence's one read position, as the critic reads its values.
        with self._on_device(), torch.no_grad():
            results = run_schedule(self.chunks, micro_batches, heads.value_head(), forward_only=True)
        return torch.cat(scatter_outputs(results, micro_batches, "values", scoring.response_lengths))

    # ---- training -------------------------------------------------------------------------

    def update(self, batch: SequenceBatch) -> dict[str, float]:
        """``ppo_epochs`` passes over ``batch`` in ``ppo_mini_batches`` optimizer steps each.

        The actor needs fields ``old_logp`` and ``advantages`` (``ref_logp`` with a KL loss); the
        critic needs ``values`` and ``returns``. Returns metrics averaged over the steps, named
        ``actor/...`` or ``critic/...``.
        """
        self.role.require("update")
        if len(batch) < self.config.ppo_mini_batches:
            raise ValueError(f"batch of {len(batch)} sequences cannot make ppo_mini_batches={self.config.ppo_mini_batches}")
        steps = []
        batch = self._with_recorded_routing(batch)
        with self._on_device():
            for _ in range(self.config.ppo_epochs):
                for indices in _contiguous_splits(len(batch), self.config.ppo_mini_batches):
                    steps.append(self._train_step(batch.select(indices)))
        prefix = self.role.name
        names = sorted({name for step in steps for name in step})
        metrics = {
            name if "/" in name else f"{prefix}/{name}": sum(step.get(name, 0.0) for step in steps) / len(steps)
            for name in names
        }
        metrics.update(getattr(self, "_routing_metrics", None) or {})  # the old-log-prob pass's (R3), once
        self._routing_metrics = None
        return metrics

    def update_on_policy(self, batch: SequenceBatch) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
        """The actor's one optimizer step on a batch scored by the current weights, without a separate
        old-log-prob pass: the update's own forward pass gives the old log-probs (detached, so the ratio
        is 1 and the gradient is the separate pass's). Needs ``ppo_epochs == 1`` and
        ``ppo_mini_batches == 1`` and no ``old_logp`` field. Returns the metrics and, per sequence, the
        log-probs and entropies ``[R_i]`` of that forward pass (what ``compute_logprobs`` would give)."""
        if not self.role.serves("update_on_policy") or self.config.ppo_epochs != 1 or self.config.ppo_mini_batches != 1:
            raise RuntimeError("update_on_policy needs the actor with ppo_epochs=1 and ppo_mini_batches=1: "
                               "with more optimizer steps per batch the old log-probs need their own pass")
        if "old_logp" in batch.fields:
            raise ValueError("update_on_policy computes the old log-probs itself; the batch has an old_logp field")
        with self._on_device():
            metrics, results, micro_batches = self._train_step(batch, with_results=True)
        lengths = batch.response_lengths
        logprobs = scatter_outputs(results, micro_batches, "logprobs", lengths)
        entropy = scatter_outputs(results, micro_batches, "entropy", lengths)
        return {f"actor/{name}" if "/" not in name else name: value for name, value in metrics.items()}, logprobs, entropy

    def sft_step(self, batch: SequenceBatch, lr: float) -> dict[str, float]:
        """One supervised step (NLL of the response tokens) at learning rate ``lr``, with the actor's
        optimizer (its state carries on into RL) and without advancing the RL schedule."""
        self.role.require("sft_step")
        with self._on_device():
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return self._train_step(batch, sft=True)

    def _train_step(self, batch: SequenceBatch, sft: bool = False, with_results: bool = False):
        """One optimizer step on ``batch``: its metrics (and, ``with_results``, the heads' results and
        the micro-batches they belong to)."""
        from megatron.core import parallel_state as ps

        self.restore_training_state()
        started = time.perf_counter()
        micro_batches = self._micro_batches(batch)
        scale = float(len(micro_batches) * ps.get_data_parallel_world_size())
        if sft:
            head = heads.sft_head(batch, vocab_size=self.spec.vocab_size,
                                  chunk_tokens=self.config.batching.logprob_chunk_tokens, backward_scale=scale)
        elif self.role.output is Output.VALUES:
            head = heads.critic_head(batch, self.config.critic_loss, backward_scale=scale)
        else:
            head = heads.policy_head(
                batch, self.config.policy_loss, vocab_size=self.spec.vocab_size,
                chunk_tokens=self.config.batching.logprob_chunk_tokens, backward_scale=scale,
            )
        self._zero_grads()
        routing = None if sft else self._routing(micro_batches)
        try:
            results = run_schedule(self.chunks, micro_batches, head, forward_only=False, routing=routing)
        finally:
            if routing is not None:
                routing.finish()
        metrics = combine_metrics(results, micro_batches)
        if routing is not None:  # how often the routers, left alone, would have chosen other experts
            metrics.update(routing.differing_fraction("update_differs"))
        loss_name = "sft_loss" if sft else self.role.loss_metric
        if math.isfinite(metrics.get(loss_name, 0.0)) and self._grads_finite():
            if not sft:
                self.scheduler.step(increment=1)  # the LR of optimizer step k is the schedule's value at k
            with direct(self.chunks[0], "optimizer step"):
                _, grad_norm, _ = self.optimizer.step()
            self.step += 0 if sft else 1
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        else:
            self.skipped_steps += 1
            warnings.warn(
                f"non-finite loss or gradient at optimizer step {self.step + 1}: step skipped, weights unchanged "
                f"({self.skipped_steps} skipped so far)"
            )
            self._zero_grads()
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["skipped_steps"] = float(self.skipped_steps)
        num_tokens = sum(batch.lengths)
        metrics.update(self._perf.report(num_tokens, time.perf_counter() - started, training=True))
        return (metrics, results, micro_batches) if with_results else metrics

    def _zero_grads(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()  # param.grad aliases the buffer after a step; clear it too

    def _grads_finite(self) -> bool:
        """Whether every rank's gradients are finite (collective). One sum per gradient buffer (Megatron keeps
        all of a chunk's gradients in a few): a NaN or infinity anywhere makes it non-finite."""
        total = torch.zeros(1, dtype=torch.float64)
        for chunk in self.chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                total += buffer.grad_data.detach().sum().double().cpu()
        if dist.is_initialized():
            dist.all_reduce(total)
        return bool(torch.isfinite(total))

    # ---- batching -------------------------------------------------------------------------

    def _micro_batches(self, batch: SequenceBatch) -> list[MicroBatch]:
        """This rank's micro-batches: its data-parallel share, split by the token budget, and under
        context parallelism its share of each micro-batch's tokens.

        Every rank holds the whole batch and computes every rank's plan, so micro-batch counts and
        (with pipeline stages) shapes agree without communication."""
        from megatron.core import parallel_state as ps

        settings, cp = self.config.batching, self.layout.cp
        use_thd = settings.packing and has_transformer_engine() and torch.cuda.is_available()
        # THD context parallelism splits every sequence in 2*cp chunks, so each gets a slot of a multiple of that.
        segment_multiple = 2 * cp if use_thd and cp > 1 else 1
        lengths = [-(-n // segment_multiple) * segment_multiple for n in batch.lengths]
        shards = balance_across_ranks(lengths, ps.get_data_parallel_world_size())
        budget = settings.max_tokens_per_microbatch * cp  # the budget is per rank; CP ranks share a micro-batch
        count = max(count_micro_batches([lengths[i] for i in shard], budget) for shard in shards)
        count = max(count, settings.min_microbatches)
        if self.layout.virtual_stages > 1:  # the interleaved schedule runs micro-batches in groups of pp
            count = -(-max(count, self.layout.pp) // self.layout.pp) * self.layout.pp
        plans = [split_by_token_budget(shard, lengths, count) for shard in shards]
        multiple = row_multiple(self.layout.tp, self.transformer_config.sequence_parallel, cp)
        shape = None
        if self.layout.pp > 1:  # stages exchange activations of one fixed shape
            if settings.packing:
                shape = (1, max(sum(lengths[i] for i in group) for plan in plans for group in plan))
            else:
                shape = (max(len(group) for plan in plans for group in plan), max(lengths))
            shape = (shape[0], -(-max(shape[1], 1) // multiple) * multiple)
        # Packed without THD attention (CPU), nearly equal lengths pad instead (``packs_better``); pipeline stages
        # exchange one fixed shape and context parallelism splits one layout, so those keep the configured one.
        choose = settings.packing and not use_thd and self.layout.pp == 1 and cp == 1
        micro_batches = [
            build_micro_batch(batch, group, pad_to_multiple=multiple, shape=shape, use_thd=use_thd,
                              packing=packs_better([lengths[i] for i in group], multiple) if choose else settings.packing,
                              segment_multiple=segment_multiple, vision=self.spec.vision)
            for group in plans[ps.get_data_parallel_rank()]
        ]
        if cp > 1:
            micro_batches = [split_micro_batch(mb, cp, ps.get_context_parallel_rank()) for mb in micro_batches]
        return micro_batches

    # ---- memory ---------------------------------------------------------------------------

    def offload(self) -> int:
        """Move parameters, gradient buffers and optimizer state to host memory; the bytes moved."""
        tensors = list(model_tensors(self.chunks))
        if self.optimizer is not None:
            tensors += list(optimizer_tensors(self.optimizer))
        return self._host.offload(tensors)

    def onload(self) -> int:
        """Bring back what ``offload`` moved; the bytes moved."""
        return self._host.onload()

    @property
    def offloaded(self) -> bool:
        return self._host.active

    def release_training_state(self) -> int:
        """Before the engines wake for a weight sync (colocated): free the gradient buffers and move the optimizer's
        state to host memory, leaving the parameters the export reads (``offload.TrainingState``). The next call
        that trains or checkpoints brings them back. The device bytes freed (0 for a role that does not train)."""
        if self.optimizer is None or self._training_state.released:
            return 0
        return self._training_state.release(self.chunks, self.optimizer)

    def restore_training_state(self) -> None:
        """Bring back what ``release_training_state`` moved (calls that train or checkpoint do it themselves)."""
        if self._training_state.released:
            self._training_state.restore()

    @contextlib.contextmanager
    def _on_device(self):
        """Onload for the call if offloaded, and offload again after (a reference's resting state)."""
        was_offloaded = self.offloaded
        if was_offloaded:
            self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    # ---- checkpoints and export -----------------------------------------------------------

    def save_checkpoint(self, root: str | Path, extra: Optional[dict] = None, step: Optional[int] = None) -> Path:
        """Save model, optimizer, LR schedule, RNG and ``extra`` as ``root/iter_{step}`` (atomic);
        ``step`` defaults to this worker's optimizer steps (a reference, which never steps, needs it)."""
        with self._on_device():
            self.restore_training_state()
            return checkpoint.save_checkpoint(
                root, self.step if step is None else step, self.chunks, self.optimizer, self.scheduler,
                layout_description=self.layout.describe(), extra={**(extra or {}), "skipped_steps": self.skipped_steps},
                adapters_only=self.config.lora.enabled and not self.base_folded,
            )

    def load_checkpoint(self, path: str | Path) -> dict:
        """Load a checkpoint saved in any layout; returns the ``extra`` it was saved with."""
        with self._on_device():
            self.restore_training_state()
            self.step, extra = checkpoint.load_checkpoint(path, self.chunks, self.optimizer, self.scheduler)
        if self.optimizer is not None:
            use_fused_cpu_adam(self.optimizer)
        self.skipped_steps = int(extra.pop("skipped_steps", 0))
        adapters_only = extra.pop("adapters_only")
        self.base_folded = self.config.lora.enabled and not adapters_only
        return extra

    def fold_adapters(self) -> None:
        """LoRA: merge the adapters into the base weights and restart them from B = 0 with fresh Adam moments. The
        model computes the same; its base (the reference, adapters off) becomes what the adapted model was: after
        a supervised warm-start, the warm-started policy."""
        if not self.config.lora.enabled:
            raise RuntimeError("fold_adapters needs a LoRA actor (actor.lora.rank > 0)")
        with self._on_device():
            self.restore_training_state()
            lora.fold(self.chunks)
            self.optimizer.reload_model_params()  # the fp32 master copies of B (bf16) follow
            clear_moments(self.optimizer)
        self.base_folded = True

    def export_hf_weights(self, bucket_bytes: Optional[int] = None, destinations: Optional[list[int]] = None):
        """The model's weights under HF names, streamed in buckets (see ``rlmega.bridge.export_hf_weights``)."""
        from rlmega.bridge import DEFAULT_BUCKET_BYTES, export_hf_weights

        if self.offloaded:
            raise RuntimeError("weights are offloaded; call onload() before exporting")
        return export_hf_weights(self.chunks, self.spec, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                 destinations=destinations)


def _contiguous_splits(size: int, parts: int) -> list[list[int]]:
    bounds = [round(size * part / parts) for part in range(parts + 1)]
    return [list(range(bounds[part], bounds[part + 1])) for part in range(parts)]

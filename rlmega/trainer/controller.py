"""The RL loop. One step, as data (see ``Trainer.train_step``):

    prompts -> engines generate n responses each (``rollout.mode``: before, or while the previous step
    trains) -> rewards -> old / ref log-probs, values
    -> rollout correction -> advantages (with on-policy distillation: the teacher's scores)
    -> critic and actor updates -> weight sync (versioned, checked)
    -> metrics

around it: resume, an optional supervised warm-start, validation, checkpoints, a final HF export,
and a clean stop on SIGTERM (checkpoint, exit code 143). The ``Trainer`` is given every part whole
(``build_trainer`` starts them on Ray); it only runs the loop.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlmega.algos.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rlmega.config.engine_sampling import truncates_engine_logprobs
from rlmega.config.schema import RLConfig
from rlmega.trainer.advantages import compute_advantages
from rlmega.trainer.distillation import Distillation
from rlmega.trainer.metrics import MetricsTracker
from rlmega.trainer.batch_assembly import Rollouts
from rlmega.trainer.prompt_side import PromptSide
from rlmega.trainer.resume import ResumeDecision, prepare_first_save, refuse_finished_run
from rlmega.trainer.metric_backends import StepRows
from rlmega.trainer.roles import Actor, Critic, Engines, Reference, Teachers, TrainingJob
from rlmega.trainer.schedules import RolloutSchedule, rollout_schedule
from rlmega.trainer.warm_start import supervised_warm_start
from rlmega.workers.batching import padded_field

PREEMPTED_EXIT_CODE = 143


class Trainer:
    def __init__(self, config: RLConfig, prompts: PromptSide, job: TrainingJob, actor: Actor, engines: Engines, *,
                 reference: Optional[Reference] = None, critic: Optional[Critic] = None,
                 teachers: Optional[Teachers] = None, start: ResumeDecision = ResumeDecision()):
        """Load the checkpoint ``start`` names (``decide_resume``: a new run by default) and open the metrics; the
        parts belong to the trainer from here on and are shut down by ``close``."""
        self.config, self.prompts, self.job, self.engines = config, prompts, job, engines
        self.actor, self.reference, self.critic, self.teachers = actor, reference, critic, teachers
        self.distillation = (Distillation(config.algorithm.distill, teachers) if config.algorithm.distill.enabled
                             else None)
        self.run_dir = Path(config.run_dir)
        self.start = start
        self._saved_before = False
        self.preempted = False
        self.steps_done = 0
        """RL steps this process has completed (a run that fails before the first leaves nothing behind)."""
        self.schedule: RolloutSchedule = rollout_schedule(prompts, engines)
        self.restarts = engines.restarts
        """``rollout.restart_dead_engines``: the engines' restart budget and counts (None: a dead engine stops it)."""
        if self.restarts is not None:
            self.restarts.serve = self._serve_current_weights
        self.total_steps = prompts.data.total_steps
        self.start_step = self._resume()
        self._synced_engines: Optional[list] = None
        """The engines the actor's weight sync was set up for (``sync``)."""
        if self.restarts is not None:
            self.restarts.step = self.start_step
        self.tracker = MetricsTracker(self.run_dir, config=config.metrics, total_steps=self.total_steps,
                                      run_config=_plain(config), resume_step=self.start_step)
        self.trained_prompts = StepRows(self.run_dir / "trained_prompts.jsonl", self.start_step)
        """One row per step: the dataset indices of the prompts trained on (an audit of the data order)."""

    # ---- the loop -------------------------------------------------------------------------

    def fit(self) -> int:
        """Run to the last step (``trainer.total_steps``, or ``trainer.total_epochs`` over the prompts) or
        to SIGTERM; the process exit code."""
        trainer = self.config.trainer
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if self.start_step == 0 and trainer.sft_steps:
                self.warm_start()
            self.sync(version=self.start_step)
            self.schedule.resume(self.start_step)
            if trainer.val_every and trainer.val_before_train and self.start_step == 0:
                self.validate(0)
            for step in range(self.start_step + 1, self.total_steps + 1):
                self.tracker.log(step, self.train_step(step))
                self.steps_done += 1
                last = step == self.total_steps
                if trainer.val_every and (step % trainer.val_every == 0 or last):
                    self.validate(step)
                if last or self.preempted or (trainer.save_every and step % trainer.save_every == 0):
                    self.save(step)
                if self.preempted:
                    print(f"preempted: checkpoint saved at step {step}", flush=True)
                    return PREEMPTED_EXIT_CODE
            if self.config.export_hf and self.config.actor.lora.enabled:  # its checkpoints hold the adapters alone
                note = self.actor.export_lora(self.run_dir / "hf", self.run_dir / "hf_adapter", self.config.model.path)
                print(f"exported HF checkpoint to {self.run_dir / 'hf'}" + (f"; note: {note}" if note else
                      f" and PEFT adapter to {self.run_dir / 'hf_adapter'}"), flush=True)
            elif self.config.export_hf:
                export_hf(self.run_dir / "checkpoints" / "actor", self.run_dir / "hf", self.config.model.path)
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.close()

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step; its metrics."""
        config, metrics = self.config, {}
        started = time.perf_counter()
        if self.restarts is not None:
            self.restarts.step = step
        with self._timed(metrics, "gen"), self._rollout_phase():
            rollouts = self.schedule.take(step)
        self.trained_prompts.write(step, {"prompts": rollouts.prompt_indices,
                                          "weight_versions": sorted(set(rollouts.weight_versions))})
        batch = rollouts.batch
        fused = self._fuses_old_logprob(step)
        old_logp = entropy = None
        if config.algorithm.rollout_correction.bypass_mode:  # the engine's log-probs are the behaviour policy's
            old_logp = rollouts.rollout_logp
        elif not fused:
            with self._timed(metrics, "old_log_prob"):
                old_logp, entropy = self.actor.compute_logprobs(batch)
        ref_logp = values = None
        if self.reference is not None:
            with self._timed(metrics, "ref"):
                ref_logp, _ = self.reference.compute_logprobs(batch)
        if self.critic is not None:
            with self._timed(metrics, "values"):
                values = self.critic.compute_values(batch)
        # The loss mask of the rollouts (overlong filtering) holds on every path; the correction may narrow it.
        fields = {} if rollouts.response_mask is None else {"response_mask": rollouts.response_mask}
        if not fused:
            correction_fields, correction_metrics = self._corrected_fields(rollouts, old_logp)
            fields.update(correction_fields)
            metrics.update(correction_metrics)
        correction = config.algorithm.rollout_correction
        rejected_first = correction.enabled and correction.reject_before_advantages and not correction.bypass_mode
        if correction.enabled and correction.bypass_mode:  # the loss corrects the current policy against the engine
            batch = dataclasses.replace(batch, rollout_correction=correction)
        advantages, returns, advantage_metrics = compute_advantages(
            config.algorithm, rollouts.scores, batch.response_lengths, rollouts.group_ids,
            response_mask=rollouts.response_mask, kl_estimator=config.actor.policy_loss.kl_estimator,
            advantage_mask=fields.get("response_mask") if rejected_first else None,
            old_logp=old_logp, ref_logp=ref_logp, values=values, baseline_scores=rollouts.baseline_scores,
            turn_rewards=rollouts.turn_rewards,
        )
        metrics.update(advantage_metrics)
        if self.critic is not None:
            with self._timed(metrics, "update_critic"):
                mask = {"response_mask": fields["response_mask"]} if "response_mask" in fields else {}
                metrics.update(self.critic.update(batch.with_fields(values=values, returns=returns, **mask)))
        if self.distillation is not None:
            with self._timed(metrics, "teacher"):
                advantages, batch, distill_metrics = self.distillation.apply(
                    batch, self._data_sources(rollouts), old_logp, advantages, rollouts.response_mask)
            metrics.update(distill_metrics)
        if config.actor.policy_loss.kl_loss_coef > 0:
            fields["ref_logp"] = ref_logp
        if fused:
            with self._timed(metrics, "update_actor"):
                update_metrics, old_logp, entropy = self.actor.update_on_policy(
                    batch.with_fields(advantages=advantages, **fields))
            metrics.update(update_metrics)
            metrics.update(self._corrected_fields(rollouts, old_logp)[1])  # the mismatch, measured after the fact
        elif step > config.trainer.critic_warmup:  # PPO's critic warm-up: the actor waits for a trained critic
            with self._timed(metrics, "update_actor"):
                metrics.update(self.actor.update(batch.with_fields(old_logp=old_logp, advantages=advantages, **fields)))
        with self._timed(metrics, "wait_rollout"):  # one_step_off / async: the generation running alongside
            self.schedule.pause()
        with self._timed(metrics, "sync"):
            metrics.update(self.sync(version=step))
        self.schedule.resume(step)
        metrics.update(rollouts.metrics)
        if self.restarts is not None:  # engines restarted since the last step, and the requests they took over
            metrics.update(self.restarts.metrics())
        if entropy is not None:
            metrics["actor/rollout_entropy"] = float(torch.cat(entropy).mean())
        metrics["timing_s/step"] = time.perf_counter() - started
        metrics["perf/throughput"] = sum(batch.lengths) / metrics["timing_s/step"]
        metrics["batch/response_tokens"] = float(sum(batch.response_lengths))
        if config.rollout.mode != "sync":  # the time the trainer waited for rollouts
            waited = metrics["timing_s/gen"] + metrics["timing_s/wait_rollout"]
            metrics["async/trainer_idle_fraction"] = waited / metrics["timing_s/step"]
        return metrics

    def _fuses_old_logprob(self, step: int) -> bool:
        """Whether this step's old log-probs come from the update's own forward pass (``trainer.fuse_old_logprob``):
        one optimizer step per batch, and nothing needs them before the update (the KL in the reward and
        on-policy distillation do)."""
        config = self.config
        return (config.trainer.fuse_old_logprob and config.actor.ppo_epochs == 1 and config.actor.ppo_mini_batches == 1
                and not config.algorithm.rollout_correction.enabled and not config.algorithm.rollout_correction.bypass_mode
                and config.algorithm.kl_in_reward_coef == 0 and not config.algorithm.distill.enabled
                and step > config.trainer.critic_warmup)

    def _data_sources(self, rollouts: Rollouts) -> list[str]:
        """Each response's ``data_source`` (which teacher scores it)."""
        dataset = self.prompts.data.dataset
        return [dataset[rollouts.prompt_indices[group]].data_source for group in rollouts.group_ids]

    def _corrected_fields(self, rollouts: Rollouts, old_logp: list[torch.Tensor]) -> tuple[dict, dict[str, float]]:
        """The loss mask and IS weights from the engine's vs the trainer's log-probs, and the mismatch metrics.
        In bypass mode the old log-probs are the engine's, and the correction happens inside the loss (against
        the current policy), so only the metrics are computed here."""
        lengths = rollouts.batch.response_lengths
        loss_mask = rollouts.response_mask or [torch.ones(n) for n in lengths]
        settings = self.config.algorithm.rollout_correction
        if settings.bypass_mode:
            settings = RolloutCorrectionConfig()
        correction = compute_rollout_correction(
            padded_field(old_logp)[0], padded_field(rollouts.rollout_logp)[0], padded_field(loss_mask)[0], settings)
        unpadded = lambda tensor: [row[:n].float().clone() for row, n in zip(tensor, lengths)]  # noqa: E731
        fields = {}
        if rollouts.response_mask is not None or settings.enabled:
            fields["response_mask"] = unpadded(correction.response_mask)
        if correction.is_weights is not None:
            fields["rollout_is_weights"] = unpadded(correction.is_weights)
        metrics = {name: float(value) for name, value in correction.metrics.items()}
        # 1: the engine's log-probs are of the top-k / top-p truncated distribution, the trainer's are not.
        metrics["mismatch/truncated_logprobs"] = float(truncates_engine_logprobs(self.config))
        return fields, metrics

    # ---- phases ---------------------------------------------------------------------------

    @property
    def _hands_over_memory(self) -> bool:
        """Colocated parts take turns with the memory (``rollout.colocated_offload``)."""
        rollout, cluster = self.config.rollout, self.config.cluster
        if rollout.placement != "colocated" or rollout.colocated_offload == "never":
            return False
        return (rollout.colocated_offload == "always" or rollout.backend != "hf" or cluster.gpus_per_rank > 0
                or rollout.gpus_per_engine > 0)

    @contextmanager
    def _rollout_phase(self):
        """Colocated: training memory goes to host while engines generate, then engines sleep."""
        hand_over = self._hands_over_memory
        if hand_over:
            self.job.set_offloaded(True)
            self.engines.wake()
        try:
            yield
        finally:
            if hand_over:
                self.engines.sleep(level=1)
                self.job.set_offloaded(False)

    def sync(self, version: int) -> dict[str, float]:
        """Push the actor's weights into every engine as ``version`` and, if configured, check them; the engines'
        own record of the version they serve is then the one the run goes by (``Engines.version``)."""
        from rlmega.sync import StaleWeightsError

        if self._hands_over_memory:  # only the parameters the export reads stay beside the woken engines
            self.job.release_training_state()
            self.engines.wake()
        engines = self.engines.handles()
        if engines != self._synced_engines:  # the first sync, or engines restarted in place since the last
            self.actor.connect(engines)  # the weight sync's transport is chosen here, once for these engines
            self._synced_engines = engines
        stats = self.actor.push_weights(version)
        metrics = {"sync/gbytes": stats.bytes / 1e9, "sync/gbps": stats.gbps}
        if self.config.sync.checks(version, first_version=self.start_step):
            metrics["sync/max_logprob_diff"] = self.actor.check_weights(self.prompts.data.probes(), version)
        served = self.engines.version()
        if served is not None and served != version:
            raise StaleWeightsError(served, version, "after the weight sync, every rollout engine")
        return metrics

    def _serve_current_weights(self, engine) -> Optional[float]:
        """An engine started in place of a dead one (``rollout.restart_dead_engines``) gets the weights of the last
        sync (those the others serve) through a weight sync of its own, the post-sync check whatever
        ``sync.check_every`` says, and the check of the version it serves: the check's largest log-prob difference
        (None with ``sync.post_sync_check=false``). The run's weight sync feeds it from the next sync on. Called only
        while the ranks are idle and hold those weights: before a step's generation, or after a sync."""
        if self._hands_over_memory:  # colocated: the ranks' weights are offloaded while the engines generate
            self.job.set_offloaded(False)
        try:
            probes = self.prompts.data.probes() if self.config.sync.post_sync_check else None
            difference = self.actor.serve_replacement(engine, probes)
        finally:
            if self._hands_over_memory:
                self.job.set_offloaded(True)
        return difference

    def validate(self, step: int) -> None:
        self.schedule.pause()  # asynchronous modes: no training rollout shares the engines meanwhile
        with self._rollout_phase():
            metrics, samples = self.prompts.validation.run(self.engines)
        self.schedule.resume(step)  # validation follows the sync of ``step``
        self.tracker.log_validation(step, metrics)
        if samples:
            self.tracker.log_generations(step, samples)

    def warm_start(self) -> None:
        supervised_warm_start(self.actor, self.prompts.warm_start)
        if self.reference is not None:
            self.reference.copy_from_actor()

    # ---- state ----------------------------------------------------------------------------

    def _resume(self) -> int:
        from rlmega.workers.checkpoint import iteration_dir

        if not self.start.step:
            return 0
        if self.config.trainer.total_epochs:  # the length needs the data; decide_resume checked total_steps
            refuse_finished_run(self.run_dir, self.start.step, self.total_steps, "trainer.total_epochs",
                                self.config.trainer.total_epochs)
        checkpoints = self.run_dir / "checkpoints"
        extra = self.job.load(str(checkpoints), self.start.step)
        self.schedule.load_state_dict(extra)
        found = iteration_dir(checkpoints / "actor", self.start.step)
        print(f"resumed from {found} (step {extra['step']})", flush=True)
        return int(extra["step"])

    def save(self, step: int) -> None:
        if not self._saved_before:
            prepare_first_save(self.run_dir, self.config, self.start)
            self._saved_before = True
        self.job.save(str(self.run_dir / "checkpoints"), {**self.schedule.state_dict(), "step": step},
                      keep=self.config.trainer.max_checkpoints_to_keep)

    def _on_sigterm(self, signum, frame) -> None:
        print("SIGTERM: finishing the current step, then saving a checkpoint", flush=True)
        self.preempted = True

    @contextmanager
    def _timed(self, metrics: dict, name: str):
        started = time.perf_counter()
        yield
        metrics[f"timing_s/{name}"] = time.perf_counter() - started

    def close(self) -> None:
        self.schedule.close()
        self.tracker.close()
        self.trained_prompts.close()
        for part in (self.engines, self.job, self.teachers):
            if part is not None:
                part.shutdown()
        self.prompts.close()


def export_hf(checkpoint: Path, output: Path, base_model: str) -> None:
    """The actor checkpoint under ``checkpoint`` as an HF checkpoint in ``output`` (names and shapes of ``base_model``)."""
    from converters.mcore_to_hf import convert

    result = convert(checkpoint, output, base_model, overwrite=True, quiet=True)
    for line in result.notes:  # an untied head kept (converters.mcore_to_hf.untied_if_trained_head)
        print(f"note: {line}", flush=True)
    print(f"exported HF checkpoint to {output}", flush=True)


def _plain(config: RLConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(config)

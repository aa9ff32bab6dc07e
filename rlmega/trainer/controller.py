"""The RL loop. One step, as data (see ``train_step``):

    prompts -> engines generate n responses each -> rewards -> old / ref log-probs, values
    -> advantages -> critic and actor updates -> weight sync (versioned, checked) -> metrics

around it: resume, an optional supervised warm-start, validation, checkpoints, a final HF export,
and a clean stop on SIGTERM (checkpoint, exit code 143).
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlmega.config.schema import RLConfig
from rlmega.trainer.advantages import compute_advantages
from rlmega.trainer.generation import generate_rollouts
from rlmega.workers.batching import SequenceBatch

PREEMPTED_EXIT_CODE = 143


class Trainer:
    def __init__(self, config: RLConfig):
        from transformers import AutoTokenizer

        from rlmega.data import PromptDataset, StatefulSampler
        from rlmega.rewards import RewardScorer

        self.config = config
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.dataset = PromptDataset(config.data, self.tokenizer)
        self.val_dataset = PromptDataset(config.val_data, self.tokenizer) if config.trainer.val_every else None
        self.sampler = StatefulSampler(len(self.dataset), config.trainer.prompts_per_step, seed=config.trainer.seed)
        self.scorer = RewardScorer(config.reward)
        self.scorer.check_data_sources(self.dataset.data_sources)
        self.stop_token_ids = (self.tokenizer.eos_token_id,)
        self.preempted = False
        self.training = self.rollout = self.tracker = None

    # ---- the loop -------------------------------------------------------------------------

    def fit(self) -> int:
        """Run to ``trainer.total_steps`` (or to SIGTERM); the process exit code."""
        from rlmega.trainer.cluster import start_workers
        from rlmega.trainer.metrics import MetricsTracker

        previous = signal.getsignal(signal.SIGTERM)
        try:
            self.training, self.rollout, placement = start_workers(self.config)
            # After ray.init, which installs a SIGTERM handler of its own that aborts the driver.
            signal.signal(signal.SIGTERM, self._on_sigterm)
            (self.run_dir / "placement.json").write_text(json.dumps(placement, indent=1))
            start = self._resume()
            self.tracker = MetricsTracker(self.run_dir, config=self.config.metrics, total_steps=self.config.trainer.total_steps,
                                          run_config=_plain(self.config), resume_step=start)
            if start == 0 and self.config.trainer.sft_steps:
                self._warm_start()
            self._sync(version=start)
            if self.config.trainer.val_every and start == 0:
                self.tracker.log_validation(0, self.validate())
            for step in range(start + 1, self.config.trainer.total_steps + 1):
                self.tracker.log(step, self.train_step(step))
                last = step == self.config.trainer.total_steps
                if self.config.trainer.val_every and (step % self.config.trainer.val_every == 0 or last):
                    self.tracker.log_validation(step, self.validate())
                if last or self.preempted or (self.config.trainer.save_every and step % self.config.trainer.save_every == 0):
                    self._save(step)
                if self.preempted:
                    print(f"preempted: checkpoint saved at step {step}", flush=True)
                    return PREEMPTED_EXIT_CODE
            if self.config.export_hf:
                self._export_hf()
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.close()

    def fit_sft(self) -> int:
        """Only the supervised warm-start (``trainer.sft_steps``), then its HF export to ``run_dir/sft_hf``."""
        from rlmega.trainer.cluster import start_workers

        try:
            self.training, _, _ = start_workers(self.config, with_rollout=False)
            self._warm_start()
            root = self.run_dir / "sft_checkpoints"
            self.training.run("save", str(root), {"sampler": self.sampler.state_dict(), "step": 0})
            self._export_hf(root / "actor", self.run_dir / "sft_hf")
            return 0
        finally:
            self.close()

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step; its metrics."""
        config, metrics = self.config, {}
        started = time.perf_counter()
        with self._timed(metrics, "gen"), self._rollout_phase():
            rollouts = generate_rollouts(self, step)
        batch = rollouts.batch
        with self._timed(metrics, "old_log_prob"):
            old_logp, entropy = self.training.call("actor", "compute_logprobs", batch)
        ref_logp = values = None
        if config.needs_reference:
            with self._timed(metrics, "ref"):
                ref_logp, _ = self.training.call("ref", "compute_logprobs", batch)
        if config.needs_critic:
            with self._timed(metrics, "values"):
                values = self.training.call("critic", "compute_values", batch)
        advantages, returns, advantage_metrics = compute_advantages(
            config.algorithm, rollouts.scores, batch.response_lengths, rollouts.group_ids,
            old_logp=old_logp, ref_logp=ref_logp, values=values,
        )
        metrics.update(advantage_metrics)
        fields = dict(old_logp=old_logp, advantages=advantages)
        if rollouts.response_mask is not None:
            fields["response_mask"] = rollouts.response_mask
        if ref_logp is not None:
            fields["ref_logp"] = ref_logp
        if config.needs_critic:
            with self._timed(metrics, "update_critic"):
                metrics.update(self.training.call("critic", "update", batch.with_fields(values=values, returns=returns, **(
                    {"response_mask": rollouts.response_mask} if rollouts.response_mask is not None else {}))))
        with self._timed(metrics, "update_actor"):
            metrics.update(self.training.call("actor", "update", batch.with_fields(**fields)))
        with self._timed(metrics, "sync"):
            metrics.update(self._sync(version=step))
        metrics.update(rollouts.metrics)
        metrics["actor/rollout_entropy"] = float(torch.cat(entropy).mean())
        metrics["timing_s/step"] = time.perf_counter() - started
        metrics["perf/throughput"] = sum(batch.lengths) / metrics["timing_s/step"]
        return metrics

    # ---- phases ---------------------------------------------------------------------------

    @contextmanager
    def _rollout_phase(self):
        """Colocated: training memory goes to host while engines generate, then engines sleep."""
        colocated = self.config.rollout.placement == "colocated"
        if colocated:
            self.training.run("set_offloaded", True)
            self.rollout.wake()
        try:
            yield
        finally:
            if colocated:
                self.rollout.sleep(level=1)
                self.training.run("set_offloaded", False)

    def _sync(self, version: int) -> dict[str, float]:
        """Push the actor's weights into every engine as ``version`` and, if configured, check them."""
        rollout = self.config.rollout
        if rollout.placement == "colocated":
            self.rollout.wake()
        stats = self.training.run("push_weights", self.rollout.engines, version, rollout.bucket_bytes, rollout.transport,
                                  self.config.cluster.timeout_s)
        metrics = {"sync/gbytes": stats.bytes / 1e9, "sync/gbps": stats.gbps}
        if rollout.post_sync_check:
            probes = [record.prompt_token_ids for record in self.dataset.batch([0, 1])]
            metrics["sync/max_logprob_diff"] = self.training.run("post_sync_check", self.rollout.engines, probes, version)
        versions = self.rollout.versions()
        if any(found != version for found in versions):
            raise RuntimeError(f"after syncing version {version} the engines serve versions {versions}")
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy (or ``rollout.val_temperature``) answers to the validation prompts, scored."""
        from rlmega.rewards import ScoreItem
        from rlmega.rollout.protocol import SamplingParams

        records = self.val_dataset.batch(list(range(min(self.config.trainer.val_prompts, len(self.val_dataset)))))
        params = SamplingParams(temperature=self.config.rollout.val_temperature, max_new_tokens=self.config.rollout.max_new_tokens,
                                stop_token_ids=self.stop_token_ids, n=1, seed=self.config.trainer.seed)
        with self._rollout_phase():
            generations = self.rollout.generate([r.prompt_token_ids for r in records], params)
        texts = [self.tokenizer.decode(g.response_token_ids, skip_special_tokens=True) for g in generations]
        scores, _ = self.scorer.score_batch([ScoreItem.from_record(r, t) for r, t in zip(records, texts)])
        return {"val/score/mean": sum(scores) / len(scores),
                "val/accuracy": sum(score >= 1.0 for score in scores) / len(scores)}

    def _warm_start(self) -> None:
        """Supervised steps on the training prompts' ground-truth answers (a tiny model's start)."""
        from rlmega.data import StatefulSampler

        # As many sequences per step as an RL step trains on.
        per_step = min(self.config.trainer.prompts_per_step * self.config.rollout.n, len(self.dataset))
        sampler = StatefulSampler(len(self.dataset), per_step, seed=self.config.trainer.seed + 1)
        for step in range(1, self.config.trainer.sft_steps + 1):
            records = self.dataset.batch(sampler.next_batch())
            tokens, prompts = [], []
            for record in records:
                answer = self.tokenizer.encode(str(record.ground_truth), add_special_tokens=False) + list(self.stop_token_ids)
                tokens.append(torch.tensor(record.prompt_token_ids + answer))
                prompts.append(len(record.prompt_token_ids))
            metrics = self.training.run("sft_step", SequenceBatch(tokens, prompts), self.config.trainer.sft_lr)
            if step == 1 or step % 10 == 0 or step == self.config.trainer.sft_steps:
                print(f"warm-start {step}/{self.config.trainer.sft_steps}: sft_loss {metrics['sft_loss']:.4f}", flush=True)
        if self.config.needs_reference:
            self.training.run("reference_from_actor")

    # ---- state ----------------------------------------------------------------------------

    def _resume(self) -> int:
        from rlmega.workers.checkpoint import latest_checkpoint

        if self.config.resume == "never":
            return 0
        found = latest_checkpoint(self.run_dir / "checkpoints" / "actor")
        if found is None:
            return 0
        extra = self.training.run("load", str(found.parent.parent), int(found.name.split("_")[1]))
        self.sampler.load_state_dict(extra["sampler"])
        print(f"resumed from {found} (step {extra['step']})", flush=True)
        return int(extra["step"])

    def _save(self, step: int) -> None:
        self.training.run("save", str(self.run_dir / "checkpoints"), {"sampler": self.sampler.state_dict(), "step": step})

    def _export_hf(self, checkpoint: Optional[Path] = None, output: Optional[Path] = None) -> None:
        from converters.mcore_to_hf import convert

        checkpoint = checkpoint or self.run_dir / "checkpoints" / "actor"
        output = output or self.run_dir / "hf"
        convert(checkpoint, output, self.config.model.path, overwrite=True, quiet=True)
        print(f"exported HF checkpoint to {output}", flush=True)

    def _on_sigterm(self, signum, frame) -> None:
        print("SIGTERM: finishing the current step, then saving a checkpoint", flush=True)
        self.preempted = True

    @contextmanager
    def _timed(self, metrics: dict, name: str):
        started = time.perf_counter()
        yield
        metrics[f"timing_s/{name}"] = time.perf_counter() - started

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        for group in (self.rollout, self.training):
            if group is not None:
                group.shutdown()
        self.scorer.close()


def _plain(config: RLConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(config)


def run(config: RLConfig) -> int:
    return Trainer(config).fit()

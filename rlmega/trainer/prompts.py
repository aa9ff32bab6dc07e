"""The prompt side of a run: dataset, sampler, tokenizer, scorer and sampling settings, shared by
training rollouts, validation, the supervised warm-start and the post-sync probes.

``PromptSource.rollouts`` turns one step's prompts into scored trajectories: n responses per prompt,
with the token ids, the engine's per-token log-probs and the weight version that produced them;
DAPO's dynamic sampling (drop groups whose scores are all equal, generate more), overlong shaping
and filtering, and ReMax's greedy baseline happen here.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Protocol, Sequence

import torch

from rlmega import algos
from rlmega.config.schema import RLConfig
from rlmega.data.dataset import PromptDatasets
from rlmega.data.schema import PromptRecord
from rlmega.errors import UserError
from rlmega.rewards.judge import JudgeEngines
from rlmega.rewards.reward_model import SequenceScorer
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.trainer.metrics import batch_metrics
from rlmega.workers.batching import SequenceBatch


class Generator(Protocol):
    """What the prompt side needs from the engines (``RolloutGroup`` or a fake)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


@dataclasses.dataclass
class Rollouts:
    """One step's trajectories, grouped by prompt (the n responses of a prompt are consecutive)."""

    batch: SequenceBatch
    """prompt + response token ids exactly as the engine saw and produced them, at the sampling temperature."""
    scores: torch.Tensor
    """``[B]`` scores after reward shaping."""
    group_ids: list[int]
    rollout_logp: list[torch.Tensor]
    """``[R_i]`` the engine's log-prob of every response token, under the sampled distribution."""
    weight_versions: list[int]
    """The oldest weight version among each response's tokens."""
    token_versions: list[torch.Tensor]
    """``[R_i]`` the weight version that produced every response token (one value per response unless an
    asynchronous run continued it with newer weights)."""
    prompt_indices: list[int]
    """The dataset index of every group's prompt."""
    response_mask: Optional[list[torch.Tensor]]
    """Per-token loss mask when overlong filtering zeroes some responses; None when all tokens count."""
    baseline_scores: Optional[torch.Tensor]
    """``[B]`` the score of the greedy response to the same prompt (ReMax), else None."""
    metrics: dict[str, float]
    turn_rewards: Optional[list[torch.Tensor]] = None
    """``[R_i]`` an agent environment's per-turn rewards at their turns' last policy tokens (parts of
    ``scores``, placed there by the advantage estimators); None without turn rewards."""


@dataclasses.dataclass
class Group:
    """The n scored responses to one prompt."""

    record: PromptRecord
    generations: list[Generation]
    scores: torch.Tensor
    """``[n]`` after reward shaping."""
    baseline: float = 0.0
    """ReMax: the greedy response's score."""
    token_versions: Optional[list[torch.Tensor]] = None
    """Per response, the weight version of every token, when it is not one version per response."""


def _seed(base: int, step: int, round_index: int) -> int:
    return (base * 1_000_003 + step * 7_919 + round_index * 104_729) % (2**31)


class PromptSource:
    """Owns the tokenizer, the training and validation datasets, the resumable sampler and the reward manager."""

    def __init__(self, config: RLConfig, *, datasets: Optional[PromptDatasets] = None,
                 reward_model: Optional[SequenceScorer] = None, judge: Optional[JudgeEngines] = None):
        """``datasets``: the prompts as the start-up checks read them (``rlmega.config.validate``); None reads them
        here. ``reward_model`` and ``judge`` (started by ``cluster.start_reward_workers``) belong to the prompt
        source from here on: its reward manager scores with them and ``close`` shuts them down."""
        from transformers import AutoTokenizer

        from rlmega.data import StatefulSampler
        from rlmega.data.images import image_prompts_for
        from rlmega.trainer.reward_manager import build_reward_manager

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.processor = image_prompts_for(config.model.path, config.model.tokenizer_path, self.tokenizer,
                                           multi_turn=config.agent.enabled)
        """A vision-language model's processor (its images' pixels and pad tokens); None for text models."""
        if datasets is None:
            datasets = PromptDatasets.read(config.data, config.val_data if config.trainer.val_every else None,
                                           self.tokenizer, self.processor)
        self.dataset, self.val_dataset = datasets.train, datasets.val
        self.sampler = StatefulSampler(len(self.dataset), config.trainer.prompts_per_step, seed=config.trainer.seed)
        self.rewards = build_reward_manager(config, self.tokenizer, reward_model=reward_model, judge=judge)
        """The reward manager: rules, user function, reward model and judge, weighted per data source."""
        self.rewards.check_data_sources(self.dataset.data_sources)
        if self.val_dataset is not None:
            self.rewards.check_data_sources(self.val_dataset.data_sources, validation=True)
        self.stop_token_ids = (self.tokenizer.eos_token_id,)
        self.agent = self._agent_loop() if config.agent.enabled else None
        """With ``agent.enabled``, the multi-turn loop (``rlmega.agent``) that produces every response."""
        self.needs_greedy_baseline = config.algorithm.adv_estimator == "remax"
        epochs = config.trainer.total_epochs
        self.total_steps = epochs * self.sampler.steps_per_epoch if epochs else config.trainer.total_steps
        """The run's RL steps: ``trainer.total_epochs`` passes over the prompts, or ``trainer.total_steps``."""

    def _agent_loop(self):
        from rlmega.agent.loop import AgentLoop

        if not self.config.data.use_chat_template:
            raise UserError("agent.enabled: needs data.use_chat_template=true (tool outputs follow the chat template)")
        return AgentLoop(self.config.agent, self.tokenizer, stop_token_ids=self.stop_token_ids,
                         chat_template_kwargs=self.config.data.chat_template_kwargs)

    # ---- sampling and scoring ---------------------------------------------------------------

    def generate(self, engines: Generator, records: Sequence[PromptRecord], params: SamplingParams) -> list[Generation]:
        """``params.n`` responses per record, prompt-major: one generation each, or the agent loop's trajectories."""
        if self.agent is not None:
            return self.agent.run(engines, records, params)
        prompts = [record.prompt_token_ids for record in records]
        if any(record.images is not None for record in records):
            return engines.generate(prompts, params, images=[record.images for record in records])
        return engines.generate(prompts, params)

    def sampling_params(self, *, temperature: float, n: int, seed: Optional[int]) -> SamplingParams:
        rollout = self.config.rollout
        sampled = temperature > 0
        return SamplingParams(temperature=temperature, top_p=rollout.top_p if sampled else 1.0,
                              top_k=rollout.top_k if sampled else None, max_new_tokens=rollout.max_new_tokens,
                              stop_token_ids=self.stop_token_ids, n=n, seed=seed)

    def score(self, records: Sequence, generations: list[Generation]) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[len(generations)]`` of responses to ``records[g.prompt_index]``, and the reward manager's
        metrics. Responses to validation prompts are scored with the validation weights
        (``reward.val_weights``). Thread-safe (the manager serialises calls)."""
        from rlmega.rewards import ScoreItem

        texts = [self.tokenizer.decode(g.response_token_ids, skip_special_tokens=True) for g in generations]
        items = [ScoreItem.from_record(records[g.prompt_index], text, g.response_token_ids)
                 for g, text in zip(generations, texts)]
        if self.agent is not None:  # the scorer also gets the episode: final answer, turns, tool calls
            from rlmega.agent.loop import episode_info

            for item, generation in zip(items, generations):
                episode = episode_info(generation)
                item.extra_info = {**(item.extra_info or {}), "agent": episode}
                item.prompt_token_ids = generation.prompt_token_ids  # rendered with the tools
                if self.config.agent.scored_text == "final_answer":
                    item.solution_str = episode["final_answer"]
        val = self.val_dataset  # a validation record is the validation dataset's own record at its index
        validation = val is not None and all(r.index < len(val) and val[r.index] is r for r in records)
        scores, metrics = self.rewards.score_batch(items, validation=validation)
        # An agent's environment rewards its episode too (0 without one).
        scores = [score + getattr(g, "env_reward", 0.0) for score, g in zip(scores, generations)]
        return torch.tensor(scores, dtype=torch.float32), metrics

    def rollouts(self, engines: Generator, step: int) -> Rollouts:
        """Generate and score responses until the step has ``prompts_per_step`` usable groups (DAPO's
        dynamic sampling may take several rounds), or the round limit is reached."""
        config, algorithm = self.config, self.config.algorithm
        wanted = config.trainer.prompts_per_step
        kept: list[Group] = []
        rounds = algorithm.max_generation_rounds if algorithm.dynamic_sampling else 1
        all_scores, all_generations, reward_metrics, dropped = [], [], {}, 0
        for round_index in range(rounds):
            records = self.dataset.batch(self.sampler.next_batch())
            seed = _seed(config.trainer.seed, step, round_index)
            generations = self.generate(engines, records, self.sampling_params(
                temperature=config.rollout.temperature, n=config.rollout.n, seed=seed))
            raw_scores, reward_metrics = self.score(records, generations)
            all_scores.append(raw_scores)
            all_generations.extend(generations)
            scores = self.shape_scores(raw_scores, generations)
            baselines = torch.zeros(len(records))
            if self.needs_greedy_baseline:
                greedy = self.generate(engines, records, self.sampling_params(temperature=0.0, n=1, seed=None))
                baselines = self.score(records, greedy)[0]
            group_ids = [g.prompt_index for g in generations]
            keep = range(len(records))
            if algorithm.dynamic_sampling:
                result = algos.dynamic_sampling_filter(torch.tensor(group_ids), scores)
                keep = sorted({group_ids[i] for i in result.kept_indices.tolist()})
                dropped += result.num_dropped_groups
            for prompt_index in keep:
                members = [i for i, g in enumerate(group_ids) if g == prompt_index]
                kept.append(Group(records[prompt_index], [generations[i] for i in members], scores[members],
                                  float(baselines[prompt_index])))
            if len(kept) >= wanted:
                break
        kept = kept[:wanted]
        if not kept:
            raise RuntimeError(
                f"step {step}: every prompt group had equal scores in {rounds} generation rounds, nothing to train on; "
                "raise algorithm.max_generation_rounds or rollout.n, or turn off algorithm.dynamic_sampling"
            )
        metrics = self.generation_metrics(torch.cat(all_scores), all_generations, reward_metrics)
        metrics.update({"batch/generation_rounds": float(round_index + 1), "batch/dropped_groups": float(dropped)})
        return self.assemble(kept, metrics)

    def shape_scores(self, scores: torch.Tensor, generations: list[Generation]) -> torch.Tensor:
        """Scores after DAPO's overlong shaping (when configured)."""
        algorithm = self.config.algorithm
        if not algorithm.overlong_buffer_length:
            return scores.clone()
        lengths = torch.tensor([len(g.response_token_ids) for g in generations])
        longest = self.config.agent.max_response_tokens if self.agent is not None else self.config.rollout.max_new_tokens
        return scores + algos.overlong_reward_penalty(
            lengths, max_response_length=longest,
            overlong_buffer_length=algorithm.overlong_buffer_length, penalty_factor=algorithm.overlong_penalty_factor)

    @staticmethod
    def generation_metrics(scores: torch.Tensor, generations: list[Generation],
                           reward_metrics: dict[str, float]) -> dict[str, float]:
        """Scores and lengths of everything generated for a step (kept or not), and the scorer's metrics."""
        metrics = batch_metrics(scores, [len(g.response_token_ids) for g in generations],
                                truncated=[g.finish_reason == "length" for g in generations])
        metrics.update({name if "/" in name else f"reward/{name}": value for name, value in reward_metrics.items()})
        if generations and hasattr(generations[0], "loss_mask"):  # an agent's trajectories
            from rlmega.agent.loop import agent_metrics

            metrics.update(agent_metrics(generations))
        return metrics

    def assemble(self, kept: list[Group], metrics: dict[str, float]) -> Rollouts:
        """The trainer's batch from whole groups, in order."""
        algorithm = self.config.algorithm
        tokens, prompts, scores, group_ids, masks, logps, versions, token_versions, baselines = ([] for _ in range(9))
        for group_index, group in enumerate(kept):
            for sample, (generation, score) in enumerate(zip(group.generations, group.scores)):
                # An agent's trajectory starts from its own prompt (rendered with the tools).
                prompt = getattr(generation, "prompt_token_ids", group.record.prompt_token_ids)
                tokens.append(torch.tensor(prompt + generation.response_token_ids))
                prompts.append(len(prompt))
                scores.append(float(score))
                group_ids.append(group_index)
                logps.append(torch.tensor(generation.logprobs, dtype=torch.float32))
                length = len(generation.response_token_ids)
                produced_by = (torch.full((length,), generation.weight_version, dtype=torch.long)
                               if group.token_versions is None else group.token_versions[sample])
                token_versions.append(produced_by)
                versions.append(int(produced_by.min()) if length else generation.weight_version)
                baselines.append(group.baseline)
                truncated = algorithm.filter_truncated and generation.finish_reason == "length"
                own_tokens = getattr(generation, "loss_mask", None)  # an agent's: 0 on tool output and glue
                mask = torch.ones(length) if own_tokens is None else torch.tensor(own_tokens, dtype=torch.float32)
                masks.append(mask * (0.0 if truncated else 1.0))
        metrics["batch/num_sequences"] = float(len(tokens))
        # R3: the engines' routing of every token, replayed by the actor (None unless every engine recorded it).
        routing = [generation.routing for group in kept for generation in group.generations]
        routing = routing if routing and all(r is not None and r.shape[0] == t.numel()
                                             for r, t in zip(routing, tokens)) else None
        turn_rewards = None
        if self.agent is not None and any(getattr(g, "turn_rewards", None) for group in kept for g in group.generations):
            from rlmega.agent.loop import turn_reward_tokens

            turn_rewards = [torch.tensor(turn_reward_tokens(g), dtype=torch.float32)
                            for group in kept for g in group.generations]
        images = [group.record.images for group in kept for _ in group.generations]
        return Rollouts(
            batch=SequenceBatch(tokens, prompts, temperature=self.config.rollout.temperature, routing=routing,
                                images=images if any(item is not None for item in images) else None),
            scores=torch.tensor(scores), group_ids=group_ids, rollout_logp=logps, weight_versions=versions,
            token_versions=token_versions, prompt_indices=[group.record.index for group in kept],
            response_mask=masks if algorithm.filter_truncated or self.agent is not None else None,
            baseline_scores=torch.tensor(baselines) if self.needs_greedy_baseline else None, metrics=metrics,
            turn_rewards=turn_rewards,
        )

    # ---- validation, warm-start, probes -------------------------------------------------------

    def validate(self, engines: Generator) -> tuple[dict[str, float], list[dict]]:
        """Answers to the first ``trainer.val_prompts`` validation prompts at ``rollout.val_temperature``,
        scored: the metrics, and the first ``trainer.log_val_generations`` samples (prompt, response,
        ground truth, score) to show."""
        count = min(self.config.trainer.val_prompts, len(self.val_dataset))
        records = self.val_dataset.batch(list(range(count)))
        params = self.sampling_params(temperature=self.config.rollout.val_temperature, n=1, seed=self.config.trainer.seed)
        generations = self.generate(engines, records, params)
        scores, _ = self.score(records, generations)
        samples = [
            {"prompt": self.tokenizer.decode(records[g.prompt_index].prompt_token_ids, skip_special_tokens=True),
             "response": self.tokenizer.decode(g.response_token_ids, skip_special_tokens=True),
             "ground_truth": str(records[g.prompt_index].ground_truth), "score": float(score)}
            for g, score in list(zip(generations, scores))[:self.config.trainer.log_val_generations]
        ]
        metrics = {"val/score/mean": float(scores.mean()), "val/accuracy": float((scores >= 1.0).float().mean())}
        return metrics, samples

    def warm_start_batches(self) -> Iterator[SequenceBatch]:
        """``trainer.sft_steps`` batches of training prompts with their ground-truth answers (a tiny
        model's start), as many sequences each as an RL step trains on."""
        from rlmega.data import StatefulSampler

        per_step = min(self.config.trainer.prompts_per_step * self.config.rollout.n, len(self.dataset))
        sampler = StatefulSampler(len(self.dataset), per_step, seed=self.config.trainer.seed + 1)
        demonstration = None
        if self.agent is not None and self.config.agent.demonstration is not None:
            from rlmega.agent.functions import load_callable

            demonstration = load_callable(self.config.agent.demonstration)
        for _ in range(self.config.trainer.sft_steps):
            records = self.dataset.batch(sampler.next_batch())
            if demonstration is not None:
                yield self._demonstrated(records, demonstration)
                continue
            tokens, prompts = [], []
            for record in records:
                answer = self.tokenizer.encode(str(record.ground_truth), add_special_tokens=False)
                tokens.append(torch.tensor(record.prompt_token_ids + answer + list(self.stop_token_ids)))
                prompts.append(len(record.prompt_token_ids))
            images = [record.images for record in records]
            yield SequenceBatch(tokens, prompts, images=images if any(item is not None for item in images) else None)

    def _demonstrated(self, records: Sequence[PromptRecord], demonstration) -> SequenceBatch:
        """The agent's trajectories with ``agent.demonstration``'s turns, masked to train on those turns only."""
        from rlmega.agent.loop import example_of

        turns = []
        for record in records:
            texts = demonstration(example_of(record))
            if not isinstance(texts, (list, tuple)) or not all(isinstance(text, str) for text in texts):
                raise UserError(f"agent.demonstration {self.config.agent.demonstration}: returned {texts!r} for "
                                f"row {record.index}; it must return a list of assistant turn texts")
            turns.append(texts)
        trajectories = self.agent.demonstrate(records, turns)
        return SequenceBatch([torch.tensor(t.prompt_token_ids + t.response_token_ids) for t in trajectories],
                             [len(t.prompt_token_ids) for t in trajectories],
                             fields={"response_mask": [torch.tensor(t.loss_mask, dtype=torch.float32)
                                                       for t in trajectories]})

    def probes(self) -> list[list[int]]:
        """Prompts the post-sync check generates from: text only (a vision-language prompt without its image
        markup), so the check compares the language model's weights; the vision tower is not probed."""
        prompts = [record.prompt_token_ids for record in self.dataset.batch([0, 1])]
        if self.processor is None:
            return prompts
        markup = set(self.tokenizer.encode(self.processor.markup, add_special_tokens=False))
        return [[token for token in prompt if token not in markup] for prompt in prompts]

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        """End the scoring processes, the tool workers, and the reward model's ranks and the judge's engines if any."""
        self.rewards.close()
        if self.agent is not None:
            self.agent.close()

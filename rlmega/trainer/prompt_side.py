"""The prompt side of a run, in parts, and the one place that reads them out of the run's config.

    prompts = build_prompt_side(config, datasets, reward_model=reward_model, judge=judge)
    rollouts = prompts.step_rollouts.take(engines, step)      # or a schedule (``rollout_schedule``)

- ``data`` (``prompt_data.py``): tokenizer, datasets, the resumable sampler, the run's length, probes;
- ``generator`` (``generation.py``): the engines or the agent loop, sampling parameters and seeds;
- ``scorer`` (``scoring.py``): the reward manager, an agent's episode, overlong shaping;
- ``assembler`` (``batch_assembly.py``): scored groups into the trainer's ``Rollouts``;

and composed from them: a step's generation rounds (``step_rollouts.py``: DAPO's dynamic sampling, ReMax's
greedy baseline), validation (``validation.py``), the warm-start's batches (``warm_start.py``), and the settings
of ``rollout.mode``'s schedule (``schedules.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlmega.config.schema import RLConfig
from rlmega.data import PromptDatasets
from rlmega.rewards.judge import JudgeEngines
from rlmega.rewards.reward_model import SequenceScorer
from rlmega.trainer.batch_assembly import AssemblyConfig, BatchAssembler
from rlmega.trainer.generation import GeneratorConfig, ResponseGenerator
from rlmega.trainer.prompt_data import PromptData, PromptDataConfig
from rlmega.trainer.reward_manager import RewardManagerConfig
from rlmega.trainer.schedules import ScheduleConfig
from rlmega.trainer.scoring import Scorer, ScorerConfig
from rlmega.trainer.step_rollouts import StepRollouts, StepRolloutsConfig
from rlmega.trainer.validation import Validation, ValidationConfig
from rlmega.trainer.warm_start import WarmStart, WarmStartConfig


@dataclasses.dataclass
class PromptSide:
    data: PromptData
    generator: ResponseGenerator
    scorer: Scorer
    assembler: BatchAssembler
    step_rollouts: StepRollouts
    validation: Validation
    warm_start: WarmStart
    schedule: ScheduleConfig

    def close(self) -> None:
        """End the scoring processes, the tool workers, and the reward model's ranks and the judge's engines if any."""
        self.scorer.close()
        self.generator.close()


def build_prompt_side(config: RLConfig, datasets: Optional[PromptDatasets] = None, *,
                      reward_model: Optional[SequenceScorer] = None,
                      judge: Optional[JudgeEngines] = None) -> PromptSide:
    """The prompt side of the run ``config`` describes. ``datasets``: the prompts as the start-up checks read them
    (``rlmega.config.validate``); None reads them here. ``reward_model`` and ``judge`` (started by
    ``cluster.start_reward_workers``) belong to the prompt side from here on: its scorer scores with them and
    ``close`` shuts them down."""
    rollout, trainer, algorithm, agent = config.rollout, config.trainer, config.algorithm, config.agent
    gateway = config.gateway if config.gateway.enabled else None
    # The agent loop's trajectories or the harness's (through the gateway): scored and warm-started alike.
    scored_text = agent.scored_text if agent.enabled else gateway.scored_text if gateway else None
    demonstration = agent.demonstration if agent.enabled else gateway.demonstration if gateway else None
    multi_turn = agent.enabled or gateway is not None  # trajectories with masked tokens between the policy's
    remax = algorithm.adv_estimator == "remax"
    data = PromptDataConfig(
        model_path=config.model.path, tokenizer_path=config.model.tokenizer_path, data=config.data,
        val_data=config.val_data if trainer.val_every else None, prompts_per_step=trainer.prompts_per_step,
        seed=trainer.seed, total_steps=trainer.total_steps, total_epochs=trainer.total_epochs,
        multi_turn=multi_turn,
    ).build(datasets)
    generator = GeneratorConfig(
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens, n=rollout.n, seed=trainer.seed,
        agent=agent if agent.enabled else None, use_chat_template=config.data.use_chat_template,
        chat_template_kwargs=config.data.chat_template_kwargs,
        gateway=gateway,
    ).build(data.tokenizer)
    try:
        scorer = ScorerConfig(
            rewards=RewardManagerConfig(config.reward, config.reward_model, config.judge, seed=trainer.seed),
            agent_scored_text=scored_text,
            overlong_buffer_length=algorithm.overlong_buffer_length,
            overlong_penalty_factor=algorithm.overlong_penalty_factor,
            max_response_length=agent.max_response_tokens if agent.enabled else rollout.max_new_tokens,
        ).build(data.tokenizer, data_sources=data.dataset.data_sources,
                val_data_sources=None if data.val_dataset is None else data.val_dataset.data_sources,
                reward_model=reward_model, judge=judge)
    except BaseException:
        generator.close()
        raise
    assembler = AssemblyConfig(temperature=rollout.temperature, filter_truncated=algorithm.filter_truncated,
                               multi_turn=multi_turn, greedy_baseline=remax).build()
    step_rollouts = StepRollouts(
        StepRolloutsConfig(prompts_per_step=trainer.prompts_per_step, dynamic_sampling=algorithm.dynamic_sampling,
                           dynamic_sampling_metric=algorithm.dynamic_sampling_metric,
                           max_generation_rounds=algorithm.max_generation_rounds, greedy_baseline=remax),
        data, generator, scorer, assembler)
    validation = Validation(
        ValidationConfig(num_prompts=trainer.val_prompts, temperature=rollout.val_temperature,
                         top_p=rollout.top_p if rollout.val_top_p is None else rollout.val_top_p,
                         top_k=rollout.top_k if rollout.val_top_k is None else (rollout.val_top_k or None),
                         num_responses=rollout.val_n, seed=trainer.seed, num_samples_shown=trainer.log_val_generations),
        data, generator, scorer)
    warm_start = WarmStart(
        WarmStartConfig(num_steps=trainer.sft_steps, lr=trainer.sft_lr,
                        sequences_per_step=trainer.prompts_per_step * rollout.n, seed=trainer.seed,
                        demonstration=demonstration,
                        demonstration_setting="gateway.demonstration" if gateway else "agent.demonstration"),
        data, generator)
    schedule = ScheduleConfig(
        mode=rollout.mode, prompts_per_step=trainer.prompts_per_step, n=rollout.n,
        max_staleness=rollout.max_staleness, stale_groups=rollout.stale_groups,
        partial_rollout=rollout.partial_rollout, timeout_s=config.cluster.timeout_s,
        dynamic_sampling=algorithm.dynamic_sampling, dynamic_sampling_metric=algorithm.dynamic_sampling_metric,
        max_generation_rounds=algorithm.max_generation_rounds)
    return PromptSide(data, generator, scorer, assembler, step_rollouts, validation, warm_start, schedule)

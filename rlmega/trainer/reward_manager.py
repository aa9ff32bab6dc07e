"""The run's reward manager (``rlmega.rewards.manager``) from its config: the rule scorers, the user
function, and the reward model and judge that ``cluster.start_reward_workers`` started.

    reward_model, judge, _ = start_reward_workers(config)
    settings = RewardManagerConfig(config.reward, config.reward_model, config.judge, seed=config.trainer.seed)
    manager = build_reward_manager(settings, policy_tokenizer, reward_model=reward_model, judge=judge)

The manager owns what it is given from here on: ``manager.close()`` shuts the reward model's ranks and
the judge's engines down with the scoring processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from rlmega.config.schema import JudgeConfig, RewardModelConfig
from rlmega.rewards import (
    JudgeScorer, RewardConfig, RewardManager, RewardModelScorer, RewardScorer, RewardWeights, ScoreTransform,
    enabled_components, first_number, load_function, same_tokenization,
)
from rlmega.rewards.judge import JudgeEngines
from rlmega.rewards.reward_model import SequenceScorer


@dataclasses.dataclass
class RewardManagerConfig:
    reward: RewardConfig
    """``reward``: the rule scorers, the user function, the weights per data source and for validation."""
    reward_model: RewardModelConfig
    """``reward_model``: its tokenizer, chat template, normalising and clipping (when one is started)."""
    judge: JudgeConfig
    """``judge``: its tokenizer, prompt, parser and sampling (when one is started)."""
    seed: int
    """``trainer.seed``: the judge's sampling seed."""


def build_reward_manager(config: RewardManagerConfig, policy_tokenizer: Any, *,
                         reward_model: Optional[SequenceScorer] = None,
                         judge: Optional[JudgeEngines] = None) -> RewardManager:
    """The components the run's weights use (``reward.weights``, ``data_source_weights``, ``val_weights``,
    ``monitor``), each built once; the model components from the parts given (absent parts are absent
    components, e.g. in ``rlmega sft``, which never scores)."""
    weights = RewardWeights(config.reward, enabled_components(
        user_function=config.reward.user_function is not None, reward_model=reward_model is not None,
        judge=judge is not None))
    used = {name for weights_set in (weights.default, weights.validation or {}, *weights.by_source.values())
            for name, weight in weights_set.items() if weight != 0.0} | set(weights.monitored)
    components, transforms = {}, {}
    if "rule" in used:
        components["rule"] = RewardScorer(dataclasses.replace(config.reward, user_function=None))
    if "user_function" in used and config.reward.user_function is not None:
        components["user_function"] = RewardScorer(config.reward)
    if reward_model is not None:
        tokenizer = reward_tokenizer(config.reward_model)
        retokenize = config.reward_model.retokenize == "always" or (
            config.reward_model.retokenize == "auto" and not same_tokenization(tokenizer, policy_tokenizer))
        components["reward_model"] = RewardModelScorer(reward_model, tokenizer, retokenize=retokenize,
                                                       chat_template_kwargs=config.reward_model.chat_template_kwargs)
        transforms["reward_model"] = ScoreTransform(config.reward_model.normalize, config.reward_model.clip_range)
    if judge is not None:
        settings = config.judge
        components["judge"] = JudgeScorer(
            judge, _tokenizer(settings.tokenizer_path or settings.path), template=settings.prompt_template,
            parser=load_function(settings.parser) if settings.parser else first_number,
            max_new_tokens=settings.response_length, temperature=settings.temperature,
            use_chat_template=settings.use_chat_template, seed=config.seed)
        transforms["judge"] = ScoreTransform(settings.normalize, settings.clip_range)
    return RewardManager(config.reward, components, transforms)


def reward_tokenizer(config: RewardModelConfig) -> Any:
    """The reward model's tokenizer, with ``reward_model.chat_template`` in place of its own when set."""
    tokenizer = _tokenizer(config.tokenizer_path or config.path)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

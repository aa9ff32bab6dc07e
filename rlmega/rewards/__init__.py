"""Rewards for RL: rule scorers by data source, user functions in a process pool with timeouts, a reward
model's and a generative judge's scores, and the reward manager that weighs them per data source."""

from rlmega.rewards.countdown import countdown_score
from rlmega.rewards.exact import arithmetic_score, exact_match_score
from rlmega.rewards.gsm8k import gsm8k_score
from rlmega.rewards.judge import JudgeScorer, first_number
from rlmega.rewards.manager import (COMPONENTS, ItemScore, RewardManager, RewardWeights, ScoreTransform,
                                    enabled_components)
from rlmega.rewards.math import math_score
from rlmega.rewards.pool import Outcome, ScoringPool
from rlmega.rewards.registry import RULE_SCORERS, check_data_sources, get_rule_scorer
from rlmega.rewards.reward_model import RewardModelScorer, same_tokenization
from rlmega.rewards.scorer import RewardConfig, RewardScorer, ScoreItem
from rlmega.rewards.user_function import as_score, load_function

__all__ = [
    "COMPONENTS",
    "RULE_SCORERS",
    "ItemScore",
    "JudgeScorer",
    "Outcome",
    "RewardConfig",
    "RewardManager",
    "RewardModelScorer",
    "RewardScorer",
    "RewardWeights",
    "ScoreItem",
    "ScoreTransform",
    "ScoringPool",
    "arithmetic_score",
    "as_score",
    "check_data_sources",
    "countdown_score",
    "enabled_components",
    "exact_match_score",
    "first_number",
    "get_rule_scorer",
    "gsm8k_score",
    "load_function",
    "math_score",
    "same_tokenization",
]

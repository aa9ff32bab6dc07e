"""Rewards for RL: rule scorers by data source, user functions in a process pool with timeouts, batch scoring."""

from rlmega.rewards.countdown import countdown_score
from rlmega.rewards.exact import arithmetic_score, exact_match_score
from rlmega.rewards.gsm8k import gsm8k_score
from rlmega.rewards.math import math_score
from rlmega.rewards.pool import Outcome, ScoringPool
from rlmega.rewards.registry import RULE_SCORERS, check_data_sources, get_rule_scorer
from rlmega.rewards.scorer import RewardConfig, RewardScorer, ScoreItem
from rlmega.rewards.user_function import as_score, load_function

__all__ = [
    "RULE_SCORERS",
    "Outcome",
    "RewardConfig",
    "RewardScorer",
    "ScoreItem",
    "ScoringPool",
    "arithmetic_score",
    "as_score",
    "check_data_sources",
    "countdown_score",
    "exact_match_score",
    "get_rule_scorer",
    "gsm8k_score",
    "load_function",
    "math_score",
]

"""Name lookups for configuration strings; unknown names raise a ValueError listing valid ones."""

from __future__ import annotations

from typing import Callable

import torch

from rlmega.algos._utils import lookup
from rlmega.algos.advantages import ADVANTAGE_ESTIMATORS
from rlmega.algos.aggregation import LOSS_AGG_MODES, AggregationMode
from rlmega.algos.kl import KL_ESTIMATORS
from rlmega.algos.policy_loss import POLICY_LOSS_CONFIGS, POLICY_LOSSES, Metrics
from rlmega.algos.policy_loss_base import BaseLossConfig


def get_advantage_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The advantage estimator registered as ``name`` in ``ADVANTAGE_ESTIMATORS``."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def get_policy_loss_config(name: str) -> type[BaseLossConfig]:
    """The config class of the policy loss registered as ``name`` in ``POLICY_LOSS_CONFIGS``."""
    return lookup(POLICY_LOSS_CONFIGS, name, "policy loss")


def get_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, Metrics]]:
    """The keyword function of the policy loss registered as ``name`` in ``POLICY_LOSSES``."""
    return lookup(POLICY_LOSSES, name, "policy loss")


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token KL estimator registered as ``name`` in ``KL_ESTIMATORS``."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")


def get_loss_agg_mode(name: str) -> AggregationMode:
    """The aggregation function registered as ``name`` in ``LOSS_AGG_MODES`` (prefer ``aggregate_loss``)."""
    return lookup(LOSS_AGG_MODES, name, "loss aggregation mode")

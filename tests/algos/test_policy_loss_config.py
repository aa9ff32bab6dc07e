"""Each policy loss as its own config: ``build()`` checks the options once and returns a loss with one call
signature, ``loss(logp, old_logp, advantages, mask, context)``, that gives the keyword function's numbers."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from rlmega.algos import (
    POLICY_LOSS_CONFIGS,
    POLICY_LOSSES,
    BaseLossConfig,
    CISPOLossConfig,
    ClipCovLossConfig,
    DualClipLossConfig,
    GeoMeanLossConfig,
    GSPOLossConfig,
    KLCovLossConfig,
    LossDenominators,
    PolicyLossContext,
    PPOLossConfig,
    RatioLossConfig,
    SAPOLossConfig,
    count_loss_denominators,
    get_policy_loss_config,
    keyword_function,
    loss_option_types,
    loss_options,
)

from .helpers import ALL_POLICY_LOSSES, make_batch

F64 = torch.float64

# Options away from each loss's defaults, so that a field that did not reach the math would show.
OPTIONS = {
    "ppo": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 2.0, "log_ratio_clamp": 0.8},
    "vanilla": {"clip_ratio_low": 0.15},
    "clip_higher": {"clip_ratio_high": 0.4},
    "dual_clip": {"clip_ratio_c": 1.5},
    "gspo": {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "log_ratio_clamp": 0.1},
    "cispo": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.2},
    "gpg": {},
    "reinforce": {},
    "sapo": {"tau_pos": 2.0, "tau_neg": 0.5, "log_ratio_clamp": 1.0},
    "geo_mean": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.2},
    "clip_cov": {"clip_ratio_low": 0.1, "clip_cov_ratio": 0.3, "clip_cov_lb": -1.0, "clip_cov_ub": 10.0},
    "kl_cov": {"kl_cov_ratio": 0.3, "ppo_kl_coef": 2.0},
}


def test_every_registered_name_has_a_config_and_its_keyword_function() -> None:
    assert sorted(POLICY_LOSS_CONFIGS) == sorted(ALL_POLICY_LOSSES) == sorted(OPTIONS)
    for name, config_class in POLICY_LOSS_CONFIGS.items():
        assert get_policy_loss_config(name) is config_class
        assert issubclass(config_class, BaseLossConfig) and config_class.__dataclass_params__.frozen
        assert POLICY_LOSSES[name] is keyword_function(config_class)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*kl_cov"):
        get_policy_loss_config("ppo2")


@pytest.mark.parametrize("loss_name", ALL_POLICY_LOSSES)
def test_built_loss_equals_the_keyword_function_bit_for_bit(loss_name: str) -> None:
    """Options, aggregation and every context field reach the loss: value, gradient and metrics agree exactly."""
    batch = make_batch(seed=11, batch_size=4, num_tokens=6, log_ratio_scale=1.0)
    weights = 0.5 + torch.rand(batch.mask.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    num_tokens, num_seqs = count_loss_denominators(batch.mask)
    denominators = LossDenominators(num_tokens + 5, num_seqs + 2)  # a larger global batch
    aggregation = dict(loss_agg_mode="seq-mean-token-sum-norm", norm_horizon=9.0)

    def run(call):
        logp = batch.logp.clone().requires_grad_()
        loss, metrics = call(logp)
        loss.backward()
        return loss.detach(), metrics, logp.grad

    config = POLICY_LOSS_CONFIGS[loss_name](**aggregation, **OPTIONS[loss_name])
    built = run(lambda logp: config.build()(logp, batch.old_logp, batch.advantages, batch.mask, PolicyLossContext(
        global_denominators=denominators, rollout_is_weights=weights, generator=torch.Generator().manual_seed(5))))
    generator = {"generator": torch.Generator().manual_seed(5)} if loss_name == "clip_cov" else {}
    by_keywords = run(lambda logp: POLICY_LOSSES[loss_name](
        logp, batch.old_logp, batch.advantages, batch.mask, **aggregation, **OPTIONS[loss_name],
        global_denominators=denominators, rollout_is_weights=weights, **generator))
    defaults = run(lambda logp: POLICY_LOSSES[loss_name](logp, batch.old_logp, batch.advantages, batch.mask))

    assert torch.equal(built[0], by_keywords[0]) and torch.equal(built[2], by_keywords[2])
    assert built[1].keys() == by_keywords[1].keys()
    assert all(torch.equal(built[1][name], by_keywords[1][name]) for name in built[1])
    assert not torch.equal(built[0], defaults[0])  # the options and the context changed the loss


def test_the_context_is_optional() -> None:
    batch = make_batch(seed=2, batch_size=3, num_tokens=5)
    loss = GSPOLossConfig().build()
    assert torch.equal(loss(batch.logp, batch.old_logp, batch.advantages, batch.mask)[0],
                       loss(batch.logp, batch.old_logp, batch.advantages, batch.mask, PolicyLossContext())[0])


@pytest.mark.parametrize(("config", "option"), [
    (PPOLossConfig(clip_ratio_c=1.0), "clip_ratio_c"),
    (PPOLossConfig(clip_ratio_low=1.0), "clip_ratio_low"),
    (DualClipLossConfig(clip_ratio_high=-0.1), "clip_ratio_high"),
    (GSPOLossConfig(clip_ratio_low=-1e-4), "clip_ratio_low"),
    (CISPOLossConfig(clip_ratio_high=-0.5), "clip_ratio_high"),
    (SAPOLossConfig(tau_neg=0.0), "tau_neg"),
    (GeoMeanLossConfig(clip_ratio_high=-0.1), "clip_ratio_high"),
    (ClipCovLossConfig(clip_cov_ratio=0.0), "clip_cov_ratio"),
    (KLCovLossConfig(kl_cov_ratio=2.0), "kl_cov_ratio"),
    (KLCovLossConfig(ppo_kl_coef=-1.0), "ppo_kl_coef"),
])
def test_build_refuses_an_option_the_loss_cannot_use(config: BaseLossConfig, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        config.build()  # before any tensor is seen


def test_a_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPOLossConfig().clip_ratio_low = 0.3


def test_loss_options_are_the_fields_but_the_aggregation_own_first() -> None:
    assert loss_options(PPOLossConfig) == ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "log_ratio_clamp")
    assert loss_options(SAPOLossConfig) == ("tau_pos", "tau_neg", "log_ratio_clamp")
    assert loss_options(POLICY_LOSS_CONFIGS["gpg"]) == ()


@dataclasses.dataclass(frozen=True)
class _TemperedLossConfig(RatioLossConfig):
    """A loss with one new option and one option of PPO's."""

    temperature: float = 1.0
    clip_ratio_low: Optional[float] = 0.2


@dataclasses.dataclass(frozen=True)
class _CountingLossConfig(BaseLossConfig):
    temperature: int = 1


def test_option_types_are_the_union_of_the_losses_options() -> None:
    types = loss_option_types([PPOLossConfig, _TemperedLossConfig])
    assert types == {"clip_ratio_low": Optional[float], "clip_ratio_high": Optional[float],
                     "clip_ratio_c": Optional[float], "log_ratio_clamp": Optional[float],
                     "temperature": Optional[float]}
    with pytest.raises(TypeError, match="temperature .* _CountingLossConfig; give it one type"):
        loss_option_types([_TemperedLossConfig, _CountingLossConfig])

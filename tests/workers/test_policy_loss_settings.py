"""The flat ``actor.policy_loss`` section: its loss parameters come from the losses' own configs, and
``loss_config()`` / ``build()`` pick the named loss's config with the parameters that are set."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch

from rlmega.algos import (
    POLICY_LOSS_CONFIGS,
    POLICY_LOSSES,
    ClipHigherLossConfig,
    GSPOLossConfig,
    PolicyLossContext,
    ReinforceLossConfig,
    SAPOLossConfig,
    loss_options,
)
from rlmega.workers.config import LOSS_PARAMETERS, PolicyLossConfig


def test_loss_parameters_are_every_option_of_every_loss() -> None:
    options = {option for config_class in POLICY_LOSS_CONFIGS.values() for option in loss_options(config_class)}
    assert set(LOSS_PARAMETERS) == options
    fields = {field.name: field for field in dataclasses.fields(PolicyLossConfig)}
    for name in LOSS_PARAMETERS:
        assert fields[name].default is None and fields[name].type == Optional[float], name


def test_loss_config_is_the_named_losss_config_with_the_set_parameters() -> None:
    assert PolicyLossConfig(name="clip_higher", clip_ratio_low=0.1).loss_config() == ClipHigherLossConfig(
        clip_ratio_low=0.1)  # clip_ratio_high left to clip-higher's 0.28
    # The section's aggregation is passed as it is (GSPO's own default is seq-mean-token-mean).
    assert PolicyLossConfig(name="gspo", norm_horizon=64.0).loss_config() == GSPOLossConfig(
        loss_agg_mode="token-mean", norm_horizon=64.0)
    assert PolicyLossConfig(name="sapo", tau_neg=0.9, loss_agg_mode="seq-mean-token-mean").loss_config() == (
        SAPOLossConfig(tau_neg=0.9))


def test_clamp_log_ratio_false_turns_off_the_clamp_of_a_loss_that_has_one() -> None:
    assert PolicyLossConfig(name="gspo", clamp_log_ratio=False).loss_config().log_ratio_clamp is None
    assert PolicyLossConfig(name="gpg", clamp_log_ratio=False).loss_config() == ReinforceLossConfig()


@pytest.mark.parametrize(("settings", "message"), [
    (dict(name="ppo", tau_pos=1.0), "policy_loss.tau_pos is not a parameter of policy loss 'ppo' (it takes "
                                    "clip_ratio_low, clip_ratio_high, clip_ratio_c, log_ratio_clamp); unset it with "
                                    "policy_loss.tau_pos=null"),
    (dict(name="gpg", log_ratio_clamp=5.0), "policy_loss.log_ratio_clamp is not a parameter of policy loss 'gpg' "
                                            "(it takes none of them); unset it with policy_loss.log_ratio_clamp=null"),
    (dict(name="sapo", clip_ratio_c=2.0, clip_cov_lb=0.0), "policy_loss.clip_cov_lb is not a parameter of policy "
                                                           "loss 'sapo' (it takes tau_pos, tau_neg, log_ratio_clamp)"),
])
def test_a_parameter_the_loss_does_not_take_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        PolicyLossConfig(**settings).loss_config()
    assert str(error.value).startswith(message)


def test_build_gives_the_loss_with_the_settings() -> None:
    generator = torch.Generator().manual_seed(0)
    logp, old_logp, advantages = (torch.randn(2, 5, generator=generator, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 5)
    loss, _ = PolicyLossConfig(name="dual_clip", clip_ratio_c=1.5, loss_agg_mode="seq-mean-token-sum").build()(
        logp, old_logp, advantages, mask, PolicyLossContext())
    expected, _ = POLICY_LOSSES["dual_clip"](logp, old_logp, advantages, mask, clip_ratio_c=1.5,
                                             loss_agg_mode="seq-mean-token-sum")
    assert torch.equal(loss, expected)


# A loss whose config adds an option, registered before the worker config is imported: the flat section,
# its YAML merge, the refusal of options and the --from-verl table all take it from that one class.
NEW_OPTION = textwrap.dedent("""
    import dataclasses
    from omegaconf import OmegaConf
    from rlmega.algos import PPOLossConfig
    from rlmega.algos.policy_loss import POLICY_LOSS_CONFIGS

    @dataclasses.dataclass(frozen=True)
    class SoftPPOLossConfig(PPOLossConfig):
        softness: float = 0.5
        '''How soft the clip is.'''

    POLICY_LOSS_CONFIGS["soft_ppo"] = SoftPPOLossConfig

    from rlmega.config.verl_rules import VERL_POLICY_LOSSES
    from rlmega.workers.config import PolicyLossConfig

    section = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PolicyLossConfig),
                                                  {"name": "soft_ppo", "softness": 0.25}))
    assert section.loss_config() == SoftPPOLossConfig(softness=0.25), section.loss_config()
    try:
        PolicyLossConfig(name="ppo", softness=0.25).loss_config()
    except ValueError as error:
        assert "softness is not a parameter of policy loss 'ppo'" in str(error), error
    else:
        raise AssertionError("softness was not refused for ppo")
    assert "softness" not in VERL_POLICY_LOSSES["vanilla"][1]
    print("ok")
""")


def test_an_option_added_to_one_loss_config_reaches_the_yaml_section() -> None:
    done = subprocess.run([sys.executable, "-c", NEW_OPTION], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-3000:]

"""The engines' own rules on the sampling settings, refused or warned about when the config loads (before any engine
starts): vLLM's temperature bounds (vllm/sampling_params.py) and its top-k / top-p truncated log-probs, which
bypass_mode would make the old policy's."""

import warnings

import pytest
import torch

from rlmega.config import ConfigError, load_config
from rlmega.config.load import check_settings

ON_GPUS = ["rollout.placement=colocated", "rollout.gpus_per_engine=0", "cluster.gpus_per_rank=1"]


@pytest.fixture
def settings(monkeypatch):
    """``settings(*overrides)``: check_settings of tiny_cpu with those overrides (this machine declared to have GPUs);
    returns the warnings it gave."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def check(*overrides):
        config = load_config("tiny_cpu", list(overrides), check=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_settings(config)
        return [str(w.message) for w in caught]

    return check


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 2.5, "rollout.temperature: vLLM refuses temperatures above 2, got 2.5"),
    ("val_temperature", 3.0, "rollout.val_temperature: vLLM refuses temperatures above 2"),
    ("temperature", 0.005, "rollout.temperature: vLLM raises temperatures below 0.01 to 0.01"),
])
def test_vllm_temperature_bounds_are_refused_at_load(settings, field, value, message):
    with pytest.raises(ConfigError, match=message):
        settings("rollout.backend=vllm", *ON_GPUS, f"rollout.{field}={value}")
    settings("rollout.backend=sglang", *ON_GPUS, f"rollout.{field}={value}")  # SGLang takes them as given


def test_truncated_vllm_logprobs_are_refused_as_the_old_policys_and_warned_about_otherwise(settings):
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.bypass_mode: vLLM's log-probs under "
                                          r"rollout.top_k=20 .* set rollout.top_k=null and rollout.top_p=1.0"):
        settings("rollout.backend=vllm", *ON_GPUS, "rollout.top_k=20", "algorithm.rollout_correction.bypass_mode=true")
    noted = settings("rollout.backend=vllm", *ON_GPUS, "rollout.top_p=0.9")
    assert any("mismatch/truncated_logprobs" in note for note in noted), noted
    assert not settings("rollout.backend=vllm", *ON_GPUS, "algorithm.rollout_correction.bypass_mode=true")
    assert not settings("rollout.backend=sglang", *ON_GPUS, "rollout.top_k=20",
                        "algorithm.rollout_correction.bypass_mode=true")  # SGLang's log-probs are the full ones

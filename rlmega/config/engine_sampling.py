"""The rollout engines' own rules on the sampling settings, checked when the config loads, before any engine starts.

vLLM 0.33 / 0.34 (vllm/sampling_params.py): ``SamplingParams`` refuses a temperature above 2 (``_verify_args``) and
raises one in (0, 0.01) to 0.01 (``__post_init__``, ``_MAX_TEMP``), while the trainer would score the batch at the
configured temperature. Its log-probs (``logprobs_mode="processed_logprobs"``, vllm/v1/sample/sampler.py) are taken
after top-k / top-p, renormalised over the tokens kept; the trainer and SGLang use the full distribution. With
``algorithm.rollout_correction.bypass_mode`` the engine's log-probs are the old policy's, so the truncation would
bias every ratio: refused. Otherwise it only widens the mismatch the metrics report (``mismatch/truncated_logprobs``),
except at ``top_k=1`` with a temperature above 0: the kept distribution is one token, every log-prob exactly 0.0,
refused (vllm/v1/sample/sampler.py, ``Sampler.sample``).
"""

from __future__ import annotations

from rlmega.config.schema import RLConfig

VLLM_MAX_TEMPERATURE = 2.0
VLLM_MIN_TEMPERATURE = 0.01


def truncates_engine_logprobs(config: RLConfig) -> bool:
    """Whether the engines return log-probs of the top-k / top-p truncated distribution (vLLM with either set)."""
    rollout = config.rollout
    return rollout.backend == "vllm" and (rollout.top_k not in (None, 0, -1) or rollout.top_p < 1)


def sampling_problems(config: RLConfig) -> list[tuple[str, str]]:
    """``(field, what is wrong and how to fix it)`` for each sampling setting the engine cannot serve as configured."""
    rollout, problems = config.rollout, []
    if rollout.backend == "vllm":
        for field in ("temperature", "val_temperature"):
            value = getattr(rollout, field)
            if value > VLLM_MAX_TEMPERATURE:
                problems.append((f"rollout.{field}", f"vLLM refuses temperatures above {VLLM_MAX_TEMPERATURE:g}, got "
                                 f"{value}; use at most {VLLM_MAX_TEMPERATURE:g}"))
            elif field == "temperature" and 0 < value < VLLM_MIN_TEMPERATURE:
                problems.append((f"rollout.{field}", f"vLLM raises temperatures below {VLLM_MIN_TEMPERATURE:g} to "
                                 f"{VLLM_MIN_TEMPERATURE:g}, so it would sample at another temperature than the trainer "
                                 f"scores at ({value}); use 0 (greedy) or at least {VLLM_MIN_TEMPERATURE:g}"))
    if rollout.backend == "vllm" and rollout.top_k == 1 and rollout.temperature > 0:
        problems.append(("rollout.top_k", f"top_k=1 at temperature {rollout.temperature} with vLLM samples the argmax "
                         "and reports the log-prob of a one-token distribution, exactly 0.0 on every token, which no "
                         "mismatch metric can tell from agreement; set rollout.temperature=0 for greedy sampling, or "
                         "rollout.top_k=null"))
    if truncates_engine_logprobs(config) and config.algorithm.rollout_correction.bypass_mode:
        problems.append(("algorithm.rollout_correction.bypass_mode",
                         f"vLLM's log-probs under rollout.top_k={rollout.top_k} / rollout.top_p={rollout.top_p} are of "
                         "the truncated distribution, and bypass_mode makes them the old policy's, which biases every "
                         "ratio: set rollout.top_k=null and rollout.top_p=1.0, set bypass_mode=false, or use "
                         "rollout.backend=sglang"))
    return problems


def sampling_warnings(config: RLConfig) -> list[str]:
    """What the run should know of how its engines sample, though it can run."""
    if not truncates_engine_logprobs(config):
        return []
    return [f"rollout.top_k={config.rollout.top_k} / rollout.top_p={config.rollout.top_p} with vLLM: the engine's "
            "log-probs are of the truncated distribution and the trainer's of the full one, so the mismatch metrics "
            "include the truncation (mismatch/truncated_logprobs is 1)"]

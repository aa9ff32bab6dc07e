"""The reward model's, the judge's and the reward manager's settings: the shipped reward-model config
validates, and settings that cannot work are refused at load, naming the field."""

import re
import shutil

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.tiny_reward_model import prepare_tiny_reward_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    paths = prepare_tiny_assets(run_dir / "assets", num_train=64, num_val=16)
    prepare_tiny_reward_model(run_dir / "assets" / "reward_model", policy_dir=paths["model"],
                              train_files=[paths["train"]], steps=4, prompts_per_step=4)
    # The same reward model with a tokenizer that has no chat template (so it differs from the policy's).
    from transformers import AutoTokenizer

    bare = run_dir / "bare_reward_model"
    shutil.copytree(run_dir / "assets" / "reward_model", bare)
    tokenizer = AutoTokenizer.from_pretrained(bare)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    (run_dir / "parse.py").write_text("def parse(text):\n    return 1.0\n")
    return run_dir


def test_the_reward_model_config_resolves_as_documented(run_dir):
    config = load_config("tiny_cpu_rm", [f"run_dir={run_dir}"])
    assert config.reward_model.enable and config.reward_model.path == f"{run_dir}/assets/reward_model"
    assert config.reward.weights == {"reward_model": 1.0} and config.reward.val_weights == {"rule": 1.0}
    assert config.reward_model.layout.world_size == 1 and config.tiny_reward_model
    worker = config.reward_model.worker_config()
    assert worker.role == "reward" and worker.batching.max_tokens_per_microbatch == 4096
    judge = load_config("tiny_cpu_rm", [f"run_dir={run_dir}", "judge.enable=true", f"judge.path={run_dir}/assets/model",
                                        f"judge.parser={run_dir}/parse.py:parse", "+reward.weights.judge=0.5"])
    assert judge.judge.engine_config().placement == "disaggregated"


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.path=/nonexistent"], "reward_model.path: no HF checkpoint (config.json) at /nonexistent"),
    (["reward_model.path=${run_dir}/assets/model"],
     "reward_model.path: the reward role needs a sequence-classification"),
    (["reward_model.layout.tp=3", "reward_model.layout.world_size=3"], "reward_model.layout"),
    (["reward_model.retokenize=sometimes"], "reward_model.retokenize: 'sometimes' is not one of auto, always, never"),
    (["reward_model.normalize=zscore"], "reward_model.normalize: 'zscore' is not one of none, batch, running"),
    (["reward_model.clip_range=[1.0,0.0]"], "reward_model.clip_range: must be [low, high] with low < high"),
    (["reward_model.max_tokens_per_microbatch=0"], "reward_model.max_tokens_per_microbatch: must be an int >= 1"),
    (["reward_model.path=${run_dir}/bare_reward_model"], "reward_model.chat_template: the reward model's tokenizer"),
    (["+reward.weights.judge=1.0"], "reward.weights.judge: the run has no judge component (set judge.enable=true)"),
    (["+reward.weights.rm=1.0"], "reward.weights.rm: 'rm' is not a reward component"),
    (["reward_model.enable=false"], "reward.weights.reward_model: the run has no reward_model component"),
    (["judge.enable=true"], "judge.path: no HF checkpoint (config.json) at None"),
    (["judge.enable=true", "judge.path=${run_dir}/assets/model", "judge.prompt_template='{answer}'"],
     "judge.prompt_template: unknown field {answer}"),
    (["judge.enable=true", "judge.path=${run_dir}/assets/model", "judge.parser=/nonexistent.py:parse"],
     "judge.parser: reward function"),
    (["judge.enable=true", "judge.path=${run_dir}/assets/model", "judge.parser=${run_dir}/parse.py:grade"],
     "has no function grade"),
    (["judge.enable=true", "judge.path=${run_dir}/assets/model", "judge.tensor_parallel_size=2"],
     "judge.tensor_parallel_size: the hf engine runs on one device"),
    (["judge.backend=trt"], "judge.backend: 'trt' is not one of hf, vllm, sglang"),
    (["judge.enable=true", "judge.path=${run_dir}/assets/model", "judge.temperature=-1.0"], "judge.temperature"),
])
def test_reward_settings_that_cannot_work_are_refused_by_name(run_dir, overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):  # ConfigError, or the parser file's own error
        load_config("tiny_cpu_rm", [f"run_dir={run_dir}", *overrides])

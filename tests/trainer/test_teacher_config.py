"""The ``teacher:`` section: a teacher with the student's tokenizer validates; settings that cannot work, and a
teacher whose tokenizer is not the student's, are refused at load in one line naming the field (and both
tokenizers); ``tiny_teacher`` builds the quickstart's teacher, which solves the task."""

import shutil

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.trainer.assets import prepare_tiny_assets
from rlmega.trainer.tiny_reward_model import prepare_tiny_reward_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The tiny policy and data; a teacher with another vocabulary; a teacher with the same vocabulary but another
    end-of-text token; a reward model (a score head, no LM head)."""
    from rlmega.data import build_char_tokenizer

    run_dir = tmp_path_factory.mktemp("run")
    paths = prepare_tiny_assets(run_dir / "assets", num_train=64, num_val=16)
    other = run_dir / "other_vocabulary"
    shutil.copytree(paths["model"], other)
    build_char_tokenizer(vision=True).save_pretrained(other)  # three more tokens after the characters
    other_eos = run_dir / "other_eos"
    shutil.copytree(paths["model"], other_eos)
    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = "<pad>"
    tokenizer.save_pretrained(other_eos)
    prepare_tiny_reward_model(run_dir / "reward_model", policy_dir=paths["model"], train_files=[paths["train"]],
                              steps=4, prompts_per_step=4)
    return run_dir


def _load(run_dir, *overrides):
    return load_config("tiny_cpu", [f"run_dir={run_dir}", "teacher.enable=true",
                                    "teacher.path=${run_dir}/assets/model", "algorithm.distill.coef=1", *overrides])


def test_a_teacher_with_the_students_tokenizer_validates(run_dir):
    config = _load(run_dir, "teacher.top_k=8", "teacher.offload=true", "teacher.max_tokens_per_microbatch=512")
    assert config.teacher.top_k == 8 and list(config.teacher.models()) == [None]
    worker = config.teacher.worker_config()
    assert worker.role == "teacher" and worker.offload and worker.batching.max_tokens_per_microbatch == 512
    assert "teacher.enable (the teacher has ranks of its own)" in config.in_process_obstacles()


@pytest.mark.parametrize("overrides, message", [
    (["teacher.path=null"], "teacher.path: no checkpoint given; set it to the teacher's HF checkpoint directory"),
    (["teacher.path=/nonexistent"], "teacher.path: no HF checkpoint (config.json) at /nonexistent"),
    (["teacher.path=${run_dir}/reward_model"], "teacher.path: the teacher computes log-probs and needs a causal LM"),
    (["teacher.top_k=-1"], "teacher.top_k: must be an int >= 0"),
    (["teacher.cpus_per_rank=0"], "teacher.cpus_per_rank: must be > 0, got 0"),
    (["teacher.dtype=fp16"], "teacher.dtype: 'fp16' is not one of bf16, fp32"),
    (["teacher.max_tokens_per_microbatch=0"], "teacher.max_tokens_per_microbatch: must be an int >= 1, got 0"),
    (["teacher.layout.tp=3", "teacher.layout.world_size=3"], "teacher.layout: "),
    (["teacher.enable=false", "tiny_teacher=true", "algorithm.distill.coef=0"],
     "tiny_teacher: trains a teacher that nothing uses"),
    (["algorithm.distill.coef=0"], "teacher.enable: starts a teacher that nothing uses: algorithm.distill.coef is 0; "
                                   "set algorithm.distill.coef > 0 to distill from it, or teacher.enable=false"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(run_dir, overrides, message):
    with pytest.raises(UserError) as raised:
        _load(run_dir, *overrides)
    text = str(raised.value)
    assert text.startswith(message) and "\n" not in text


@pytest.mark.parametrize("teacher, token", [
    ("other_vocabulary", "the first differing token is '<|vision_start|>' (id 104 in the teacher's, absent from "
                         "the student's)"),
    ("other_eos", "the first differing token is the eos_token ('<pad>' in the teacher's, '<eos>' in the student's)"),
])
def test_a_teacher_with_another_tokenizer_is_refused_naming_both_and_the_first_differing_token(run_dir, teacher, token):
    with pytest.raises(UserError) as raised:
        _load(run_dir, f"teacher.path={run_dir}/{teacher}")
    text = str(raised.value)
    assert text.startswith(f"teacher.path: cross-tokenizer distillation is not supported: the teacher's tokenizer "
                           f"({run_dir}/{teacher}) differs from the student's ({run_dir}/assets/model): {token}")
    assert "\n" not in text


def test_a_teacher_per_data_source_is_checked_under_its_own_name(run_dir, tmp_path):
    config_file = tmp_path / "opd.yaml"
    config_file.write_text(f"defaults:\n  - tiny_cpu\n  - _self_\nteacher:\n  enable: true\n"
                           f"  path: {run_dir}/assets/model\n  per_data_source:\n"
                           f"    gsm8k: {{path: {run_dir}/other_vocabulary}}\n"
                           "algorithm:\n  distill: {coef: 1.0}\n")
    with pytest.raises(UserError, match=r"^teacher\.per_data_source\.gsm8k\.path: cross-tokenizer distillation"):
        load_config(str(config_file), [f"run_dir={run_dir}"])
    config = load_config(str(config_file), [f"run_dir={run_dir}", f"teacher.per_data_source.gsm8k.path={run_dir}/assets/model"])
    assert list(config.teacher.models()) == [None, "gsm8k"]
